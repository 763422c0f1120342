"""attnlab.generate and ``attnlab generate``: batches against one prompt at a time, the cached loop against
rerunning the model, greedy tokens against transformers' ``generate`` (Llama and DeepSeek-V3 with the same
weights), sampling filters against transformers' logits warpers."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
import transformers
from typer.testing import CliRunner

from attnlab import AttentionConfig, MLAConfig, ModelConfig
from attnlab.cli import app
from attnlab.cost import weight_bytes_read
from attnlab.data import shakespeare, train_byte_bpe
from attnlab.families.base import freeze
from attnlab.generate import filter_logits, generate, sample_next
from attnlab.hf.causal_lm import load_causal_lm, save_causal_lm
from attnlab.model import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 101
ATTENTION = {
    "mha": AttentionConfig(d_model=64, n_heads=4),
    "gqa": AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2),
    "mqa": AttentionConfig(d_model=64, n_heads=4, n_kv_heads=1),
    "mla": MLAConfig(
        d_model=64, n_heads=4, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16
    ),
}


def model(variant: str, dtype: torch.dtype = torch.float32) -> Transformer:
    cfg = ModelConfig(vocab_size=VOCAB, n_layers=2, attention=ATTENTION[variant], ffn_dim=96, max_seq_len=512)
    m = Transformer(cfg)
    m.init_weights(std=0.3, seed=0)  # wide logits: greedy choices are far from ties
    return m.to(dtype).eval()


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("variant", ATTENTION)
@pytest.mark.parametrize("lengths", [[7, 30, 1, 18], [12, 12, 12]])
def test_a_batch_decodes_token_for_token_as_its_prompts_one_at_a_time(variant, lengths):
    m, rows = model(variant), prompts(lengths)
    stop = generate(m, [rows[0]], 20).tokens[0][5]  # a token the first row emits: that row stops early
    batch = generate(m, rows, 20, stop_tokens=[stop], block_size=8)
    assert batch.cache == ("contiguous" if len(set(lengths)) == 1 else "paged")
    for row, prompt in enumerate(rows):
        alone = generate(m, [prompt], 20, stop_tokens=[stop])
        paged = generate(m, [prompt], 20, stop_tokens=[stop], cache="paged", block_size=4)
        assert batch.tokens[row] == alone.tokens[0] == paged.tokens[0]
        assert batch.stopped[row] == alone.stopped[0] == (stop in alone.tokens[0])
    assert batch.stopped[0] and batch.tokens[0][-1] == stop and len(batch.tokens[0]) <= 6


def test_a_sliding_layers_paged_pool_holds_its_window_not_the_whole_sequence(monkeypatch):
    """Issue 30: a sliding layer's paged cache gives back the blocks that leave its window, so ``generate`` sizes
    its pool by the window (each row: its prompt, or the blocks a window can touch) and decodes past it with the
    tokens of the whole-sequence rerun; the full layers keep whole pools."""
    from attnlab.attention.gqa import GroupedQueryAttention

    window, block_size, new = 6, 4, 40
    attn = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2)
    cfg = ModelConfig(vocab_size=VOCAB, n_layers=3, attention=attn, ffn_dim=96, max_seq_len=512,
                      sliding=attn.replace(window=window),
                      layer_types=("sliding_attention", "full_attention", "sliding_attention"))  # fmt: skip
    m = Transformer(cfg)
    m.init_weights(std=0.3, seed=0)
    m.eval()
    pools: list[tuple[int | None, int]] = []
    make = GroupedQueryAttention.new_paged_cache

    def recorded(self, n_blocks, *args, **kwargs):
        pools.append((self.cfg.window, n_blocks))
        return make(self, n_blocks, *args, **kwargs)

    monkeypatch.setattr(GroupedQueryAttention, "new_paged_cache", recorded)
    rows = prompts([3, 13])
    batch = generate(m, rows, new, cache="paged", block_size=block_size)
    whole = sum(-(-(len(r) + new) // block_size) for r in rows)  # 11 + 14 blocks
    spans = (window - 1) // block_size + 2
    assert pools == [(window, spans + 4), (None, whole), (window, spans + 4)] and spans + 4 < whole
    with torch.no_grad():
        for prompt, got in zip(rows, batch.tokens, strict=True):
            tokens = list(prompt)
            for _ in range(new):
                tokens.append(int(m(torch.tensor([tokens]))[0, -1].argmax()))
            assert got == tokens[len(prompt) :]


@pytest.mark.parametrize("variant", ATTENTION)
def test_cached_generation_equals_rerunning_the_whole_sequence(variant):
    m, (prompt,) = model(variant), prompts([9])
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            tokens.append(int(m(torch.tensor([tokens]))[0, -1].argmax()))
    assert generate(m, [prompt], 10).tokens[0] == tokens[9:]


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_a_sliding_layer_reads_at_most_its_window_of_each_row(cache):
    """The roofline's bytes of a batch: each row's keys and values in a full layer, at most a window of each row's
    in a sliding one. The window once capped the rows' sum, so three rows read what one did."""
    window, new = 4, 5
    attn = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2)
    cfg = ModelConfig(vocab_size=VOCAB, n_layers=2, attention=attn, ffn_dim=96, max_seq_len=512,
                      sliding=attn.replace(window=window), layer_types=("sliding_attention", "full_attention"))  # fmt: skip
    m = Transformer(cfg)
    m.init_weights(std=0.3, seed=0)
    rows = prompts([9, 9, 9] if cache == "contiguous" else [9, 12, 3])
    gen = generate(m.eval(), rows, new, cache=cache, stop_tokens=[])
    per_token = 2 * 2 * 16 * 4  # one layer: (k, v) x kv heads x head_dim x float32
    attended = [
        [len(r) + 1 + s for r in rows] for s in range(new - 1)
    ]  # each row's cached tokens, step by step
    kv = sum(per_token * (n + min(n, window)) for step in attended for n in step)
    assert gen.decode_bytes == (new - 1) * weight_bytes_read(m.cfg, 3, torch.float32) + kv


def test_prefill_scores_only_the_last_positions():
    m = model("gqa")
    x = torch.tensor(prompts([2, 2]))
    with torch.no_grad():
        torch.testing.assert_close(m(x, logits_to_keep=1), m(x)[:, -1:], rtol=1e-5, atol=1e-5)
        assert m(x, logits_to_keep=1).shape == (2, 1, VOCAB)
    with pytest.raises(ValueError, match="logits_to_keep"):
        m(x, logits_to_keep=-1)


def test_timings_and_roofline_bytes_are_accounted():
    m, rows = model("gqa"), prompts([5, 9])
    gen = generate(m, rows, 6, block_size=4)
    assert gen.new_tokens == 12 and gen.decode_tokens == 10 and gen.decode_steps == 5
    assert gen.prefill_s > 0 and gen.decode_s > 0 and gen.tokens_per_s > 0
    # rows of 5 and 9 tokens attend to 6..10 and 10..14 cached tokens over the 5 steps
    assert gen.kv_tokens_read == sum(range(6, 11)) + sum(range(10, 15))
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head_dim x float32
    assert gen.decode_bytes == 5 * weight_bytes_read(m.cfg, 2, torch.float32) + gen.kv_tokens_read * per_token
    # a step reads every parameter but the embedding table, of which it gathers one row per token
    embedding = m.tok_embeddings.weight
    params = sum(p.numel() * 4 for p in m.parameters()) - embedding.numel() * 4
    assert weight_bytes_read(m.cfg, 2, torch.float32) == params + 2 * embedding.shape[1] * 4


# ---------------------------------------------------------------------------------------- against transformers


def _llama(tmp_path, **overrides):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=256, **overrides,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(std=0.3)
    hf.save_pretrained(tmp_path / "llama")
    return hf, tmp_path / "llama"


def _deepseek(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10,
        first_k_dense_replace=2, n_routed_experts=0, num_mtp_layers=0, max_position_embeddings=256,
    )  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.3 if "norm" not in name else 0.1)
    hf.save_pretrained(tmp_path / "deepseek")
    return hf, tmp_path / "deepseek"


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_greedy_tokens_equal_transformers_generate(tmp_path, family):
    hf, path = _llama(tmp_path) if family == "llama" else _deepseek(tmp_path)
    ours = load_causal_lm(path)
    rows = prompts([11, 4, 23])
    batch = generate(ours, rows, 16)
    for row, prompt in enumerate(rows):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        assert batch.tokens[row] == ref[0, len(prompt) :].tolist()


def test_a_deepseek_checkpoint_saves_like_its_source_whatever_its_rope_layout(tmp_path):
    _, path = _deepseek(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"rope_interleave": False}))
    model_ = load_causal_lm(path)
    out = save_causal_lm(model_.state_dict(), model_.cfg, tmp_path / "copy", like=path)
    again = load_causal_lm(out)
    x = torch.tensor(prompts([13]))
    with torch.no_grad():
        assert torch.equal(again(x), model_(x))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, None, None), (1.3, 5, None), (1.0, None, 0.6),
                                                     (0.5, 20, 0.9), (1.0, 3, 0.2)])  # fmt: skip
def test_sampling_filters_equal_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )  # fmt: skip

    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k is not None:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        warpers.append(TopPLogitsWarper(top_p))
    ref = warpers(None, logits.clone())
    ours = filter_logits(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
    torch.testing.assert_close(ours[torch.isfinite(ours)], ref[torch.isfinite(ref)])


def test_sampling_is_seeded_and_stays_inside_the_filter():
    m, rows = model("gqa"), prompts([6, 6])
    a = generate(m, rows, 12, temperature=1.0, top_k=4, seed=7)
    assert a.tokens == generate(m, rows, 12, temperature=1.0, top_k=4, seed=7).tokens
    assert a.tokens != generate(m, rows, 12, temperature=1.0, top_k=4, seed=8).tokens
    greedy = generate(m, rows, 12).tokens
    assert generate(m, rows, 12, temperature=0.8, top_k=1, seed=1).tokens == greedy
    assert generate(m, rows, 12, temperature=0.8, top_p=1e-9, seed=1).tokens == greedy
    logits = torch.randn(2000, 7, generator=torch.Generator().manual_seed(0))
    drawn = sample_next(logits, 1.0, 2, None, torch.Generator().manual_seed(0))
    top2 = logits.topk(2, dim=-1).indices
    assert bool((drawn[:, None] == top2).any(dim=-1).all())


def test_a_tiny_temperature_samples_the_likeliest_token():
    # A QA reproduction: temperature 1e-40 (or --temperature 1e-300) raised "probability tensor contains either
    # inf, nan or element < 0" where any temperature > 0 is accepted.
    logits = torch.randn(50, 7, generator=torch.Generator().manual_seed(0)) * 4
    for t in (1e-40, 1e-300, 5e-324):
        assert torch.equal(
            sample_next(logits, t, None, None, torch.Generator().manual_seed(0)), logits.argmax(-1)
        )
    m, rows = model("gqa"), prompts([6, 6])
    assert generate(m, rows, 8, temperature=1e-40, seed=0).tokens == generate(m, rows, 8).tokens


def test_bad_arguments_are_refused_naming_the_field():
    m = model("gqa")
    for kwargs, field in [
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=True), "top_p"),  # read as 1.0 (top_k=True was refused)
        (dict(cache="ring"), "cache"),
        (dict(block_size=0), "block_size"),
    ]:
        with pytest.raises(ValueError, match=field):
            generate(m, [[1, 2]], **({"max_new_tokens": 2} | kwargs))
    with pytest.raises(ValueError, match="empty"):
        generate(m, [[1], []], 2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(m, [[1, VOCAB]], 2)
    with pytest.raises(ValueError, match="one length"):
        generate(m, [[1], [1, 2]], 2, cache="contiguous")
    assert generate(m, [[1, 2]], 0).tokens == [[]]
    for kwargs, error, field in [
        (dict(stop_tokens=5), TypeError, "stop_tokens"),
        (dict(stop_tokens="ab"), TypeError, "stop_tokens"),
        (dict(stop_tokens=[VOCAB]), ValueError, "stop_tokens holds token id"),
        (dict(stop_tokens=[1.5]), TypeError, "stop_tokens holds 1.5"),
        (dict(temperature=True), ValueError, "temperature"),
        (dict(seed="1"), TypeError, "seed"),
        (dict(seed=1, generator=torch.Generator()), ValueError, "seed or generator"),
        (dict(generator=3), TypeError, "generator"),
        (dict(progress=5), TypeError, "progress"),
    ]:
        with pytest.raises(error, match=field):
            generate(m, [[1, 2]], **({"max_new_tokens": 2} | kwargs))
    with pytest.raises(TypeError, match="prompt 0 holds 'a'"):
        generate(m, [[1, "a"]], 2)


def test_stop_tokens_and_prompts_as_tensors_and_numpy_integers_are_the_same_ids():
    """A tensor of stop tokens became a set of 0-d tensors, which hash by identity: generation never stopped, and
    said so nowhere. NumPy integers in a prompt were refused as 'outside the vocabulary'."""
    import numpy as np

    m, rows = model("gqa"), prompts([6, 6])
    free = generate(m, rows, 8).tokens
    stop = free[0][1]
    want = generate(m, rows, 8, stop_tokens=[stop])
    assert want.tokens[0] == free[0][:2]
    for stops in (torch.tensor([stop]), np.array([stop]), (np.int64(stop),), [torch.tensor(stop)]):
        got = generate(m, rows, 8, stop_tokens=stops)
        assert got.tokens == want.tokens and got.stopped == want.stopped, type(stops)
    as_numpy = [[np.int64(t) for t in row] for row in rows]
    assert generate(m, as_numpy, 8).tokens == free


# ------------------------------------------------------------------------------------------------ the command


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random transformers Llama saved with a byte-level BPE tokenizer trained on a little Shakespeare."""
    text = (shakespeare() / "hamlet.txt").read_text()[:20000]
    tok = train_byte_bpe([text], VOCAB + 200)
    path = tmp_path_factory.mktemp("gen") / "ckpt"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=0,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    return path


def test_the_command_prints_text_speed_and_roofline_as_json(checkpoint):
    result = CliRunner().invoke(
        app,
        ["generate", str(checkpoint), "--prompt", "To be, or not", "--prompt", "Good night, sweet prince",
         "--max-new", "9", "--ignore-eos", "--bandwidth", "20", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    from attnlab.data import load_tokenizer

    tok, model_ = load_tokenizer(checkpoint), load_causal_lm(checkpoint)
    ids = [tok.encode(t).ids for t in ("To be, or not", "Good night, sweet prince")]
    expected = generate(model_, ids, 9).tokens
    assert [o["tokens"] for o in out["outputs"]] == expected
    assert [o["text"] for o in out["outputs"]] == [tok.decode(t) for t in expected]
    assert out["new_tokens"] == 18 and out["decode_steps"] == 8
    assert out["cache"] == ("paged" if len(ids[0]) != len(ids[1]) else "contiguous")
    assert out["bandwidth_bytes_per_s"] == 20e9 and not out["bandwidth_measured"]
    assert out["roofline_fraction"] == pytest.approx(out["decode_bytes"] / 20e9 / out["decode_s"])
    assert out["roofline_fraction"] > 0 and out["decode_tokens_per_s"] > 0 and out["prefill_s"] > 0
    assert out["decode_bytes"] == 8 * out["weight_bytes_per_step"] + sum(
        2 * 2 * 2 * 8 * 4 * (n + k) for n in map(len, ids) for k in range(1, 9)
    )


def test_the_command_compiles_the_decode_step_over_a_static_cache(checkpoint):
    args = [
        "generate",
        str(checkpoint),
        "--prompt",
        "To be, or not",
        "--max-new",
        "6",
        "--ignore-eos",
        "--json",
    ]
    result = CliRunner().invoke(app, [*args, "--compile"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["cache"] == "static" and out["compiled"] and out["compile_s"] > 0
    plain = json.loads(CliRunner().invoke(app, args).stdout)
    assert plain["cache"] == "contiguous" and not plain["compiled"] and plain["compile_s"] == 0
    assert [o["tokens"] for o in out["outputs"]] == [o["tokens"] for o in plain["outputs"]]
    tables = CliRunner().invoke(app, [*args[:-1], "--cache", "static"])
    assert tables.exit_code == 0 and "static cache" in tables.stdout
    ragged = [*args[:4], "--prompt", "Good night, sweet prince", *args[4:]]  # two lengths, decoded together
    # (compiled, a ragged batch is the same step: tests/test_static_cache.py)
    both = [
        json.loads(CliRunner().invoke(app, [*ragged, *flag]).stdout) for flag in ([], ["--cache", "static"])
    ]
    assert both[0]["cache"] == "paged" and both[1]["cache"] == "static"
    assert [o["tokens"] for o in both[0]["outputs"]] == [o["tokens"] for o in both[1]["outputs"]]


def test_the_command_stops_at_eos_and_prints_tables(checkpoint):
    result = CliRunner().invoke(app, ["generate", str(checkpoint), "--prompt", "To be", "--max-new", "3"])
    assert result.exit_code == 0, result.output
    assert "of the roofline" in result.stdout and "prefill" in result.stdout
    # the bytes the decode steps read, in digits one can check (a tiny model's step printed "0.00 GB"), said to be
    # all the steps' (it read as a step's)
    assert re.search(r"of the roofline \((\d+\.\d\d) (kB|MB) read in [12] steps, at ", result.stdout), (
        result.stdout
    )
    assert "0.00 GB" not in result.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max-new", "0"], "--max-new must be >= 1"),
        (["--max-new", "500"], "max_position_embeddings=128"),
        (["--top-p", "2", "--temperature", "1"], r"--top-p must be in (0, 1], got 2.0"),  # a flag, not top_p
        (["--top-k", "0", "--temperature", "1"], "--top-k must be >= 1, got 0"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (
            ["--top-p", "0.5"],
            "--top-p chooses among the tokens to sample, but without --temperature",
        ),  # issue 29
        (["--top-k", "5", "--top-p", "0.5"], "--top-k and --top-p choose among"),
        (["--stop", "To be or not to be"], "give a single token"),
        (["--dtype", "fp8"], "--dtype"),
        # every command's seed range: generate took -5, and 10**23 failed in torch after the load
        (["--seed", "-5", "--temperature", "1"], "--seed must be in [0, 2**64), got -5"),
        (["--seed", str(10**23)], "--seed must be in [0, 2**64)"),
        (["--prompt", "ab\udcffcd"], "is not valid UTF-8 text"),  # a shell argument in another encoding
        (["--bandwidth", "0"], "--bandwidth"),
        (["--cache", "ring"], "--cache must be one of auto, contiguous, paged, static; got 'ring'"),
        (["--cache", "paged", "--compile"], "--compile compiles the decode step over the static cache"),
        (
            ["--cache", "contiguous", "--prompt", "Good night, sweet prince"],
            "--cache contiguous needs prompts of",
        ),
    ],
)
def test_the_command_refuses_bad_input_in_one_line(checkpoint, args, message):
    result = CliRunner().invoke(app, ["generate", str(checkpoint), "--prompt", "To be", *args])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_a_stop_word_the_vocabulary_lacks_is_refused(tmp_path):
    # It once encoded as the unknown token, which then stopped every output that met any unknown word.
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from attnlab.bench.generate import stop_tokens

    tok = Tokenizer(WordLevel({"[UNK]": 0, "good": 1, "night": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    assert stop_tokens(tmp_path, tok, ["night"], ignore_eos=True, vocab_size=3) == {2}
    with pytest.raises(
        ValueError, match=r"--stop 'knight' is not in this vocabulary \(it encodes as '\[UNK\]'\)"
    ):
        stop_tokens(tmp_path, tok, ["knight"], ignore_eos=True, vocab_size=3)


def test_a_stop_text_is_looked_up_as_text_not_as_a_byte_level_symbol(tmp_path):
    """'é' named the byte-level symbol of byte 0xE9 (half of other characters' bytes): generation stopped in the
    middle of a character, where 'é' itself is 2 tokens; special tokens still stop as themselves."""
    from attnlab.bench.generate import stop_tokens
    from attnlab.data import train_byte_bpe

    tok = train_byte_bpe(["To be, or not to be: that is the question.\n" * 20], 300)
    assert tok.token_to_id("é") is not None and len(tok.encode("é").ids) == 2
    with pytest.raises(ValueError, match=r"--stop 'é' is 2 tokens in this vocabulary; give a single token"):
        stop_tokens(tmp_path, tok, ["é"], ignore_eos=True, vocab_size=300)
    assert stop_tokens(tmp_path, tok, ["<|endoftext|>", "\n"], ignore_eos=True, vocab_size=300) == {
        0,
        *tok.encode("\n").ids,
    }


def test_a_sentencepiece_newline_is_named_by_its_vocabulary_string(tmp_path):
    """SentencePiece vocabularies with byte fallback (Llama 2, Mistral) encode "\n" as "▁" + "<0x0A>": the token is
    named by its string, which a byte-level vocabulary's lookup must not do ('é' there is a byte's symbol)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    from attnlab.bench.generate import stop_tokens

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "▁be": 258}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    assert tok.encode("\n").tokens == ["▁", "<0x0A>"]
    assert stop_tokens(tmp_path, tok, ["<0x0A>"], ignore_eos=True, vocab_size=259) == {11}
    assert stop_tokens(tmp_path, tok, ["\n"], ignore_eos=True, vocab_size=259) == {
        11
    }  # without the "▁" prefix
    with pytest.raises(ValueError, match=r"--stop 'bee' is 4 tokens"):
        stop_tokens(tmp_path, tok, ["bee"], ignore_eos=True, vocab_size=259)


def test_dtype_auto_takes_the_configs_dtype_for_a_checkpoint_of_mixed_dtypes(checkpoint, tmp_path):
    """bfloat16 weights with a float32 head and norms (as some checkpoints are saved) failed under --dtype auto:
    a matmul traceback, or 'x has dtype float32 but the weights are bfloat16'; transformers' dtype='auto' loads
    the config's dtype."""
    import shutil

    from safetensors.torch import load_file, save_file

    mixed = tmp_path / "mixed"
    shutil.copytree(checkpoint, mixed)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(mixed / "model.safetensors").items()}
    for key in tensors:
        if key == "lm_head.weight" or "norm" in key:
            tensors[key] = tensors[key].float()
    save_file(tensors, mixed / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mixed / "config.json").read_text())
    (mixed / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}))
    args = ["--prompt", "To be, or not", "--max-new", "6", "--ignore-eos", "--json"]
    auto = CliRunner().invoke(app, ["generate", str(mixed), *args])
    assert auto.exit_code == 0, auto.output
    bf16 = CliRunner().invoke(app, ["generate", str(mixed), *args, "--dtype", "bf16"])
    assert json.loads(auto.stdout)["dtype"] == "bfloat16"
    tokens = [[o["tokens"] for o in json.loads(r.stdout)["outputs"]] for r in (auto, bf16)]
    assert tokens[0] == tokens[1] and len(tokens[0][0]) == 6


def test_eos_comes_from_generation_config_json_where_there_is_one_as_in_transformers(tmp_path):
    """The union of config.json's and generation_config.json's eos stopped where transformers' generate, which
    reads generation_config.json alone when it exists, goes on."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from attnlab.bench.generate import stop_tokens

    tok = Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 204}))
    assert stop_tokens(tmp_path, tok, [], ignore_eos=False, vocab_size=300) == {204}
    for written, stops in (({"eos_token_id": [250, 251]}, {250, 251}), ({}, set()), ([], {204})):
        (tmp_path / "generation_config.json").write_text(json.dumps(written))
        assert stop_tokens(tmp_path, tok, [], ignore_eos=False, vocab_size=300) == stops, written
    (tmp_path / "generation_config.json").write_text("{not json")
    assert stop_tokens(tmp_path, tok, [], ignore_eos=False, vocab_size=300) == {204}


def test_decode_step_times_round_robin_and_cache_bytes():
    # The studies' decode-speed helper: every model timed `repeats` times, caches holding prompt + steps tokens
    # (their bytes against the cost model's count).
    from attnlab.bench.generate import decode_step_times
    from attnlab.cost import kv_cache_bytes

    models = {v: model(v) for v in ("gqa", "mla")}
    scored = []  # the logits each call returns: the prefill scores the last position only, as generate's does
    for m in models.values():
        m.register_forward_hook(lambda mod, args, out: scored.append(tuple(out.shape)))
    times, nbytes = decode_step_times(models, torch.tensor(prompts([5, 5])), steps=3, repeats=2)
    assert {shape[1] for shape in scored} == {
        1
    }  # (B, T, vocab) logits failed a sweep's --batch 1000, every row
    assert {v: len(t) for v, t in times.items()} == {"gqa": 2, "mla": 2}
    assert all(t > 0 for ts in times.values() for t in ts)
    assert nbytes == {v: kv_cache_bytes(m.cfg, 2, 8, torch.float32) for v, m in models.items()}


# ---------------------------------------------------------------------------------------- longrope's switch


def _longrope_model(switch: int = 12) -> Transformer:
    """A model whose RoPE takes other factors once a forward is longer than ``switch`` (Phi-3's longrope)."""
    scaling = freeze(
        dict(
            rope_type="longrope",
            short_factor=[1.0 + 0.2 * i for i in range(8)],
            long_factor=[3.0 + 2.0 * i for i in range(8)],
            original_max_position_embeddings=switch,
            max_position_embeddings=4 * switch,
        )
    )
    attention = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, rope_scaling=scaling)
    cfg = ModelConfig(vocab_size=VOCAB, n_layers=2, attention=attention, ffn_dim=96, max_seq_len=48)
    m = Transformer(cfg)
    m.init_weights(std=0.3, seed=0)
    return m.eval()


def _rerun(m: Transformer, prompt: list[int], new: int) -> list[int]:
    """Greedy tokens by running the model on the whole sequence at every step (no cache)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            tokens.append(int(m(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_a_longrope_sequence_growing_past_its_switch_is_prefilled_again():
    """Keys cached by forwards of at most 12 tokens hold the short factors' angles: generation prefills a row again
    when it grows past 12 (as transformers' Phi-3 drops its cache), so its tokens are those of rerunning the model;
    rows of a paged batch on either side of the switch each turn at their own frequencies."""
    m = _longrope_model(switch=12)
    rows = prompts([5, 12, 14, 9], seed=3)
    want = [_rerun(m, p, 10) for p in rows]
    assert generate(m, rows, 10, block_size=4).tokens == want
    for prompt, row in zip(rows, want, strict=True):
        assert generate(m, [prompt, prompt], 10, cache="contiguous").tokens == [row, row]
    # without the second prefill, the stale keys would change the tokens of these weights
    with torch.no_grad():
        caches, prompt = m.new_caches(1, 30), rows[0]
        tokens = list(prompt)
        logits = m(torch.tensor([tokens]), caches=caches)
        for _ in range(10):
            tokens.append(int(logits[0, -1].argmax()))
            logits = m(torch.tensor([[tokens[-1]]]), caches=caches)
    assert tokens[len(prompt) :] != want[0]


def test_a_static_cache_refuses_a_longrope_model():
    # its keys are computed again, whole, past the switch: fixed shapes cannot hold that
    with pytest.raises(ValueError, match="cache='static' cannot hold a longrope model's keys"):
        generate(_longrope_model(), [[1, 2]], 3, cache="static")


def test_an_eos_the_model_cannot_produce_stops_nothing_and_a_fifo_is_not_read(tmp_path):
    # eos 300 of a 300-token model was refused naming "stop_tokens"; a FIFO as generation_config.json hung, and a
    # link to /dev/zero grew without limit
    import os

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from attnlab.bench.generate import stop_tokens

    tok = Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [300, -1, 7]}))
    assert stop_tokens(tmp_path, tok, [], ignore_eos=False, vocab_size=300) == {7}
    os.mkfifo(tmp_path / "generation_config.json")
    assert stop_tokens(tmp_path, tok, [], ignore_eos=False, vocab_size=300) == {7}  # config.json's, at once


def test_generating_past_the_models_positions_warns_and_naive_mla_takes_ragged_prompts_static():
    """The Python API went past max_seq_len without a word (transformers warns; the command refuses); ragged
    prompts with MLA's naive mode were refused under cache='auto' though the static cache decodes them."""
    m = model("gqa")
    rows = prompts([500, 3])
    with pytest.warns(
        UserWarning, match=r"its 20 new tokens take 520 positions, past the model's max_seq_len 512"
    ):
        generate(m, rows, 20)
    dynamic = ATTENTION["gqa"].replace(rope_scaling=(("rope_type", "dynamic"), ("factor", 2.0)))
    stretched = Transformer(m.cfg.replace(attention=dynamic)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # dynamic RoPE is made to go past max_seq_len: no warning
        generate(stretched, rows, 20)
    mla = model("mla")
    want = generate(mla, prompts([7, 12]), 6).tokens  # absorbed, over the paged cache
    for layer in mla.layers:
        layer.attention.mode = "naive"
    naive = generate(mla, prompts([7, 12]), 6)
    assert naive.cache == "static" and naive.tokens == want
    with pytest.raises(
        ValueError, match=r"cache='paged' needs MLA's absorbed mode: .* or use cache='static'"
    ):
        generate(mla, prompts([7, 12]), 6, cache="paged")


def test_numpy_sampling_options_and_filter_logits_arguments_are_checked():
    import numpy as np

    from attnlab.generate import filter_logits

    m = model("gqa")
    a = generate(
        m, prompts([5]), 4, temperature=np.float32(0.7), top_p=np.float32(0.9), top_k=np.int64(5), seed=1
    )
    b = generate(m, prompts([5]), 4, temperature=0.7, top_p=float(np.float32(0.9)), top_k=5, seed=1)
    assert a.tokens == b.tokens  # np.float32(0.9) was "top_p must be None or in (0, 1]"
    logits = torch.randn(2, 10)
    for bad, says in [((-1.0,), "temperature must be a finite number >= 0"), ((0.0,), "needs temperature > 0"),
                      ((1.0, 0), "top_k must be None or an int >= 1")]:  # fmt: skip
        with pytest.raises(ValueError, match=says):  # the least likely token kept, all inf, a shape error
            filter_logits(logits, *bad)
