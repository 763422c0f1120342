"""StaticKVCache and the compiled decode step (issue 34, item 3): fixed shapes, the length on the device, the mask of
visible slots; modules, the model and ``generate`` give what the contiguous cache gives, and the decode step compiles
once (``fullgraph=True``, no recompile from step to step or from call to call)."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnlab.generate as generation
from attnlab import (
    AttentionConfig,
    GroupedQueryAttention,
    MLAConfig,
    ModelConfig,
    MultiHeadLatentAttention,
    StaticKVCache,
)
from attnlab.generate import generate
from attnlab.model import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 97
GQA = AttentionConfig(d_model=48, n_heads=4, n_kv_heads=2)
MLA = MLAConfig(d_model=48, n_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
ATTENTION = {
    "mha": AttentionConfig(d_model=48, n_heads=4),
    "gqa": GQA,
    "mqa": AttentionConfig(d_model=48, n_heads=4, n_kv_heads=1),
    "window": AttentionConfig(d_model=48, n_heads=4, n_kv_heads=2, window=5, softcap=30.0),
    "mla": MLA,
    "flex": AttentionConfig(d_model=48, n_heads=4, n_kv_heads=2, backend="flex"),  # FlexAttention, as on CUDA
    "mla_flex": MLA.replace(backend="flex"),
}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ------------------------------------------------------------------------------------------------- the cache


def test_append_writes_at_the_device_length_and_returns_the_whole_buffers():
    cache = StaticKVCache(2, 3, 10, 4)
    k, v = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    keys, values = cache.append(k, v)
    assert keys is cache.k and values is cache.v and keys.shape == (2, 3, 10, 4)
    assert torch.equal(cache.k[:, :, :4], k) and torch.equal(cache.v[:, :, :4], v)
    assert not cache.k[:, :, 4:].any()  # nothing else written
    assert cache.length.device == cache.k.device and cache.length.tolist() == [4, 4] and len(cache) == 4
    k1 = torch.randn(2, 3, 1, 4)
    cache.append(k1, k1)
    assert torch.equal(cache.k[:, :, 4], k1[:, :, 0]) and len(cache) == 5
    assert cache.positions(2).tolist() == [[5, 6], [5, 6]]
    assert cache.nbytes == 2 * 2 * 3 * 10 * 4 * 4
    cache.rewind(1)
    assert len(cache) == 4 and cache.positions(1).tolist() == [[4], [4]]
    cache.crop(3)
    assert len(cache) == 3 and cache.positions(1).tolist() == [[3], [3]]
    cache.reset()
    assert len(cache) == 0 and torch.equal(cache.k[:, :, :4], k)  # reused, not cleared


def test_rows_of_different_lengths_write_and_see_their_own_slots():
    cache = StaticKVCache(3, 2, 8, 4)
    prompts = [torch.randn(1, 2, n, 4) for n in (2, 5, 1)]
    for i, k in enumerate(prompts):  # a ragged batch, prefilled one row at a time through views
        one = cache.row(i)
        assert one.batch_size == 1 and one.k.data_ptr() == cache.k[i].data_ptr()
        one.append(k, k * 2)
    assert cache.length.tolist() == [2, 5, 1] and len(cache) == 5
    step = torch.randn(3, 2, 1, 4)
    cache.append(step, step)  # one decode step of every row, each at its own position
    for i, (k, n) in enumerate(zip(prompts, (2, 5, 1), strict=True)):
        assert torch.equal(cache.k[i, :, :n], k[0]) and torch.equal(cache.v[i, :, :n], 2 * k[0])
        assert torch.equal(cache.k[i, :, n], step[i, :, 0])
        assert not cache.k[i, :, n + 1 :].any()
    assert cache.visible(1)[:, 0, 0].tolist() == [[j <= n for j in range(8)] for n in (2, 5, 1)]
    assert cache.positions(1).tolist() == [[3], [6], [2]]
    with pytest.raises(ValueError, match="row 3 of a batch of 3"):
        cache.row(3)


def test_visible_is_the_causal_rule_and_the_window_over_every_slot():
    cache = StaticKVCache(1, 1, 9, 2)
    cache.append(torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2))
    # the 3 tokens at positions 0, 1, 2: each sees the slots up to its own; one mask for all heads
    assert cache.visible(3).shape == (1, 1, 3, 9)
    assert cache.visible(3)[0, 0].tolist() == [[j <= i for j in range(9)] for i in range(3)]
    cache.append(torch.randn(1, 1, 2, 2), torch.randn(1, 1, 2, 2))  # positions 3 and 4
    assert cache.visible(2)[0, 0].tolist() == [[j <= i for j in range(9)] for i in (3, 4)]
    assert cache.visible(2, window=2)[0, 0].tolist() == [[i - 2 < j <= i for j in range(9)] for i in (3, 4)]


def test_latent_rows_keep_their_values_in_the_keys():
    cache = StaticKVCache(2, 1, 6, 10, values_in_keys=True, value_dim=7)
    rows = torch.randn(2, 1, 3, 10)
    keys, values = cache.append(rows, None)
    assert values.shape == (2, 1, 6, 7) and values.data_ptr() == keys.data_ptr()
    assert torch.equal(values[:, :, :3], rows[..., :7])
    assert cache.nbytes == 2 * 6 * 10 * 4


def test_bad_writes_are_refused_and_change_nothing():
    cache = StaticKVCache(2, 2, 4, 8)
    cache.append(torch.ones(2, 2, 3, 8), torch.ones(2, 2, 3, 8))
    before = cache.k.clone()
    for k, v, error, match in [
        (torch.zeros(2, 2, 2, 8), torch.zeros(2, 2, 2, 8), ValueError, "overflow: 3 tokens held"),
        (torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), ValueError, "batch_size=2"),
        (torch.zeros(2, 3, 1, 8), torch.zeros(2, 3, 1, 8), ValueError, "n_kv_heads=2"),
        (torch.zeros(2, 2, 1, 8), None, ValueError, "v of k's shape"),
        (torch.zeros(2, 2, 1, 8, dtype=torch.bfloat16), torch.zeros(2, 2, 1, 8), TypeError, "dtype"),
    ]:
        with pytest.raises(error, match=match):
            cache.append(k, v)
    assert len(cache) == 3 and torch.equal(cache.k, before)
    with pytest.raises(ValueError, match="value_dim=9 > head_dim=8"):
        StaticKVCache(1, 1, 4, 8, values_in_keys=True, value_dim=9)
    with pytest.raises(ValueError, match="max_seq_len"):
        StaticKVCache(1, 1, 0, 8)
    with pytest.raises(ValueError, match="crop"):
        cache.crop(5)


# ---------------------------------------------------------------------------------------------- the modules


@pytest.mark.parametrize("kind", list(ATTENTION))
def test_a_module_over_a_static_cache_equals_the_contiguous_cache(kind):
    cfg = ATTENTION[kind]
    module = (MultiHeadLatentAttention if isinstance(cfg, MLAConfig) else GroupedQueryAttention)(cfg)
    module.init_weights(std=0.3)
    module.eval()
    contiguous, static = module.new_cache(2, 16), module.new_cache(2, 16, static=True)
    assert isinstance(static, StaticKVCache) and static.static and not contiguous.static
    with torch.no_grad():
        for t in (6, 1, 1, 3, 1, 1, 1):  # a prefill, decode steps, a chunk: past the window of 5
            x = torch.randn(2, t, 48)
            assert _err(module(x, cache=static), module(x, cache=contiguous)) <= 1e-5
    assert len(static) == len(contiguous) == 14


def test_a_mask_with_a_static_cache_is_refused_before_anything_is_written():
    module = GroupedQueryAttention(GQA)
    cache = module.new_cache(1, 8, static=True)
    with pytest.raises(ValueError, match="not supported with a StaticKVCache"):
        module(torch.randn(1, 2, 48), cache=cache, attn_mask=torch.ones(2, 2, dtype=torch.bool))
    assert len(cache) == 0


# ------------------------------------------------------------------------------------------------ generation


def _model(kind: str) -> Transformer:
    m = Transformer(ModelConfig(vocab_size=VOCAB, n_layers=2, attention=ATTENTION[kind], ffn_dim=64))
    m.init_weights(std=0.3, seed=0)  # wide logits: greedy choices are far from ties
    return m.eval()


def _prompts(b: int, t: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(ATTENTION))
def test_generate_over_static_caches_gives_the_contiguous_tokens(kind):
    m, rows = _model(kind), _prompts(3, 7)
    want = generate(m, rows, 12)
    got = generate(m, rows, 12, cache="static")
    assert got.cache == "static" and want.cache == "contiguous"
    assert got.tokens == want.tokens
    assert got.decode_bytes == want.decode_bytes and got.kv_tokens_read == want.kv_tokens_read
    sampled = [
        generate(m, rows, 8, cache=c, temperature=0.9, top_k=20, seed=4).tokens for c in ("auto", "static")
    ]
    assert sampled[0] == sampled[1]


@pytest.mark.parametrize("kind", ["gqa", "window", "mla"])
def test_a_ragged_batch_over_static_caches_gives_each_prompts_tokens(kind):
    m = _model(kind)
    rows = [r.tolist() for r in _prompts(3, 11)]
    rows = [rows[0][:3], rows[1], rows[2][:7]]  # 3, 11 and 7 tokens: each prefilled alone into its row
    stop = generate(m, [rows[0]], 12).tokens[0][4]  # a token the first row emits: it stops early
    want = generate(m, rows, 12, stop_tokens=[stop], cache="paged", block_size=4)
    got = generate(m, rows, 12, stop_tokens=[stop], cache="static")
    assert got.tokens == want.tokens and got.stopped == want.stopped and got.stopped[0]
    # every row is computed to the end (as a contiguous batch), a stopped one too
    assert got.decode_steps == 11 and got.decode_rows == 33 and want.decode_rows < 33


@pytest.fixture
def graphs(monkeypatch):
    """``decode_step`` compiled with AOTAutograd and no code generation (as inductor traces it, in a second), fresh
    for the test; yields the list of the graphs dynamo handed the compiler (one per compile)."""
    torch._dynamo.reset()
    compiled = []

    def backend(graph, inputs):
        compiled.append(graph)
        return torch._dynamo.lookup_backend("aot_eager")(graph, inputs)

    step = torch.compile(generation._step, fullgraph=True, dynamic=False, backend=backend)
    monkeypatch.setattr(generation, "_COMPILED", {"cpu": step})
    yield compiled
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "kind", ["window", "flex", "mla_flex"]
)  # mla_flex: MLA's path on CUDA (no Triton for masks)
def test_the_compiled_step_is_one_graph_for_every_step_and_call(kind, graphs):
    m, rows = _model(kind), _prompts(2, 5)
    want = generate(m, rows, 10).tokens
    first = generate(m, rows, 10, compile=True)
    assert first.cache == "static" and first.tokens == want and first.compile_s > 0
    assert len(graphs) == 1  # fullgraph=True: a graph break would have raised
    again = generate(m, _prompts(2, 5) + 1, 10, compile=True)  # other tokens, same shapes: no new graph
    assert len(graphs) == 1
    assert again.tokens == generate(m, _prompts(2, 5) + 1, 10).tokens
    longer = generate(m, _prompts(2, 9), 30, compile=True)  # another length, the same slots (STATIC_SLOTS)
    assert len(graphs) == 1 and longer.tokens == generate(m, _prompts(2, 9), 30).tokens
    ragged = [[5, 6, 7], list(range(1, 12))]  # prompts of 3 and 11 tokens: the same shapes again
    assert generate(m, ragged, 10, compile=True).tokens == generate(m, ragged, 10, cache="paged").tokens
    assert len(graphs) == 1
    generate(m, _prompts(2, 9), generation.STATIC_SLOTS, compile=True)  # past them: one more shape
    assert len(graphs) == 2


def test_past_dynamos_recompile_limit_a_new_shape_decodes_eagerly_with_a_warning(graphs, monkeypatch):
    """fullgraph=True raises at dynamo's recompile limit (8 graphs of the one shared step by default): the 9th
    batch size of a long-lived process once crashed generate; it now decodes that shape eagerly, and says so once."""
    monkeypatch.setattr(generation, "_EAGER_WARNED", [])
    m = _model("gqa")
    with torch._dynamo.config.patch(recompile_limit=1):
        assert generate(m, _prompts(2, 5), 6, compile=True).tokens == generate(m, _prompts(2, 5), 6).tokens
        tries, compiled = [], generation._COMPILED["cpu"]
        monkeypatch.setitem(generation._COMPILED, "cpu", lambda *a: tries.append(1) or compiled(*a))
        with pytest.warns(UserWarning, match=r"recompile_limit = 1 models or shapes in this process"):
            third = generate(m, _prompts(3, 5), 6, compile=True)  # another batch size: a shape past the limit
        assert third.tokens == generate(m, _prompts(3, 5), 6).tokens and len(graphs) == 1
        assert len(tries) == 1  # then eager at once: each retry failed again, 3.4x an eager step
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            generate(m, _prompts(4, 5), 6, compile=True)


def test_the_compiled_mla_step_takes_no_inputs_that_alias(monkeypatch):
    """MLA's static cache holds its values in its keys' buffer. Handed to the compiler as two inputs that alias,
    they went through AOTAutograd's synthetic-base path, whose graph inductor's on-disk cache gave another process
    at another batch size: `generate --compile` then failed a stride check ("wrong number of dimensions1"). The
    graph now takes the one buffer."""
    torch._dynamo.reset()
    inputs = []

    def backend(graph, example_inputs):
        inputs.extend(t for t in example_inputs if isinstance(t, torch.Tensor))
        return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)

    step = torch.compile(generation._step, fullgraph=True, dynamic=False, backend=backend)
    monkeypatch.setattr(generation, "_COMPILED", {"cpu": step})
    m, rows = _model("mla"), _prompts(2, 5)
    assert generate(m, rows, 6, compile=True).tokens == generate(m, rows, 6).tokens
    storages = [t.untyped_storage().data_ptr() for t in inputs]
    assert inputs and len(storages) == len(set(storages))
    torch._dynamo.reset()


def test_the_compiled_step_with_inductor_gives_the_eager_tokens():
    # The real compiler (C++ code generation on a CPU): what `compile=True` runs.
    torch._dynamo.reset()
    m, rows = _model("gqa"), _prompts(1, 6)
    assert generate(m, rows, 8, compile=True).tokens == generate(m, rows, 8).tokens
    torch._dynamo.reset()


def test_bad_static_options_are_refused_naming_the_field():
    m = _model("gqa")
    with pytest.raises(ValueError, match="compile=True compiles the decode step over a static cache"):
        generate(m, [[1, 2]], 3, cache="paged", compile=True)
    with pytest.raises(ValueError, match="cache='contiguous' needs prompts of one length"):
        generate(m, [[1, 2], [3]], 3, cache="contiguous")
    with pytest.raises(TypeError, match="compile must be a bool"):
        generate(m, [[1, 2]], 3, compile="yes")
