"""One-pass calibration (``convert.model.calibrate``): the same converted weights as rerunning the model for
every layer, for both kinds of inputs ("converted" and "source"), on decoders and on a padded BERT encoder."""

from __future__ import annotations

import copy

import pytest
import torch

from attnlab import AttentionConfig, ModelConfig
from attnlab.convert import (
    attention_inputs,
    convert_model,
    convert_model_to_mla,
    fold_latent_norms,
    gqa_to_mla,
    mha_to_gqa,
)
from attnlab.convert.latent_norm import fold_latent_norm
from attnlab.convert.model import calibrate
from attnlab.hf import convert_checkpoint
from attnlab.hf.bert import BertEncoder, EncoderConfig
from attnlab.model import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


def decoder(rope: bool = True, bias: bool = False, n_kv: int = 8, n_layers: int = 3) -> Transformer:
    attn = AttentionConfig(d_model=64, n_heads=8, n_kv_heads=n_kv, rope=rope, bias=bias)
    model = Transformer(ModelConfig(VOCAB, n_layers, attn, ffn_dim=96, max_seq_len=64))
    model.init_weights(std=0.1, seed=1)  # larger than GPT-2's 0.02, so that each layer changes its inputs
    if bias:
        with torch.no_grad():
            for layer in model.layers:
                for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv):
                    lin.bias.normal_(std=0.1)
    return model.eval()


def encoder(n_layers: int = 3) -> BertEncoder:
    attn = AttentionConfig(d_model=64, n_heads=8, bias=True, rope=False)
    torch.manual_seed(2)
    model = BertEncoder(EncoderConfig(VOCAB, n_layers, attn, ffn_dim=96, max_position_embeddings=32))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(std=0.1)
    return model.eval()


def padded_batches(seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded (ids, mask) batches of uneven lengths; pads hold a real token id, so they would count."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for b, t in ((3, 9), (2, 14), (4, 6)):
        ids = torch.randint(0, VOCAB, (b, t), generator=g)
        lengths = torch.randint(2, t + 1, (b,), generator=g)
        lengths[0] = t  # one full row per batch, as calibration_batches makes them
        batches.append((ids, (torch.arange(t)[None] < lengths[:, None]).long()))
    return batches


def per_layer_reference(model, n_kv_heads: int, method: str, batches, carry: str):
    """The conversion ``calibrate`` replaced: the model rerun for every layer to collect its inputs."""
    out = copy.deepcopy(model).eval()
    for i, layer in enumerate(out.layers):
        x = attention_inputs(out if carry == "converted" else model, i, batches)
        layer.attention = mha_to_gqa(layer.attention, n_kv_heads, method, calib=x, seed=i)
    out.cfg = out.cfg.with_attention(out.layers[0].attention.cfg)
    return out


def assert_same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], msg=key)


def attention_weights_differ(a, b) -> bool:
    return any(
        not torch.allclose(p, q, rtol=1e-4, atol=1e-4)
        for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True)
        if ".attention." in name
    )


CASES = {
    "rope": lambda: decoder(rope=True),
    "no-rope-bias": lambda: decoder(rope=False, bias=True),
    "gqa4-source": lambda: decoder(n_kv=4),
    "bert": encoder,
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("method", ["fit", "grouped-fit"])
def test_one_pass_equals_per_layer_recomputation(case, method):
    model = CASES[case]()
    batches = padded_batches()
    before = copy.deepcopy(model.state_dict())
    results = {}
    for carry in ("converted", "source"):
        results[carry] = convert_model(model, 2, method, calib=batches, carry=carry)
        assert_same_weights(results[carry], per_layer_reference(model, 2, method, batches, carry))
    # The two variants are different conversions (the test can tell them apart), and the source is untouched.
    assert attention_weights_differ(results["converted"], results["source"])
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_plain_token_batches_and_layer_inputs_match_the_hooked_forward():
    # Token-id batches without a mask use every position; each layer's inputs equal those the model's own
    # forward gives that layer (the hook oracle), bit for bit.
    model = decoder()
    batches = [ids for ids, _ in padded_batches(seed=5)]
    for i, inputs in enumerate(calibrate(model, batches)):
        assert torch.equal(torch.cat(list(inputs.rows())), attention_inputs(model, i, batches))
    assert_same_weights(
        convert_model(model, 1, "fit", calib=batches),
        per_layer_reference(model, 1, "fit", batches, "converted"),
    )


def test_one_pass_runs_each_layer_once_per_batch_and_never_the_head():
    # The quadratic cost is gone: however deep the model, each batch is embedded once, every layer but the last
    # runs once in full (to give the next its inputs) and once up to its attention (to read its inputs).
    model = decoder(n_layers=5)
    batches = padded_batches()
    calls = {"embedding": 0, "output": 0, "layer": [0] * 5, "attention": [0] * 5}

    def count(key, i=None):
        def hook(*_):
            if i is None:
                calls[key] += 1
            else:
                calls[key][i] += 1

        return hook

    # Hooks are kept by the copy convert_model makes. A forward hook counts completed runs of a module; the
    # source attentions are only called to read their inputs (the converted ones replace them).
    model.tok_embeddings.register_forward_hook(count("embedding"))
    model.output.register_forward_hook(count("output"))
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(count("layer", i))
        layer.attention.register_forward_pre_hook(count("attention", i))
    convert_model(model, 2, "fit", calib=batches)
    n = len(batches)
    assert calls == {"embedding": n, "output": 0, "layer": [n, n, n, n, 0], "attention": [n] * 5}


def test_progress_is_called_after_every_layer():
    seen = []
    convert_model(decoder(), 2, "fit", calib=padded_batches(), progress=lambda *a: seen.append(a))
    assert seen == [(1, 3), (2, 3), (3, 3)]
    seen.clear()
    convert_model(decoder(), 2, "mean", progress=lambda *a: seen.append(a))
    assert seen == [(1, 3), (2, 3), (3, 3)]


def test_streamed_moment_equals_the_concatenated_one():
    attn = decoder().layers[0].attention
    chunks = [torch.randn(n, 64, dtype=torch.float64) for n in (5, 17, 3)]
    streamed = mha_to_gqa(attn, 2, "fit", calib=iter(chunks))
    whole = mha_to_gqa(attn, 2, "fit", calib=torch.cat(chunks))
    assert_same_weights(streamed, whole)


def test_mla_conversion_and_latent_norm_equal_per_layer_recomputation():
    model = decoder(n_kv=2)
    batches = padded_batches()
    mla = convert_model_to_mla(model, 12, 4, calib=batches, planes=2, mean_phase=False)
    reference = copy.deepcopy(model)
    for i, layer in enumerate(reference.layers):
        x = attention_inputs(reference, i, batches)
        layer.attention = gqa_to_mla(layer.attention, 12, rope_dim=4, stride=2, calib=x)
    reference.cfg = reference.cfg.with_attention(reference.layers[0].attention.cfg)
    assert_same_weights(mla, reference)

    # The latent norm without the balancing map: its L-BFGS fit turns differences of 1e-16 in the inputs (the
    # order of a sum) into different maps of about the same quality, so only the rest compares weight by weight.
    native, _ = fold_latent_norms(mla, batches, balance=False)
    reference = copy.deepcopy(mla)
    for i, layer in enumerate(reference.layers):
        x = attention_inputs(reference, i, batches)
        layer.attention, _ = fold_latent_norm(layer.attention, x, balance=False)
    assert_same_weights(native, reference)


def test_bad_calibration_is_refused():
    model = decoder()
    with pytest.raises(ValueError, match="carry must be one of converted, source; got 'orig'"):
        convert_model(model, 2, "fit", calib=padded_batches(), carry="orig")
    with pytest.raises(ValueError, match="non-empty"):
        next(calibrate(model, []))
    empty = [(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))]
    with pytest.raises(ValueError, match="no activations"):
        convert_model(model, 2, "fit", calib=empty)
    with pytest.raises(ValueError, match=r"calib must be \(\.\.\., d_model=64\), got \(3, 32\)"):
        mha_to_gqa(model.layers[0].attention, 2, "fit", calib=[torch.zeros(5, 64), torch.zeros(3, 32)])


def test_convert_checkpoint_reports_progress_and_the_cli_draws_a_bar(tmp_path, monkeypatch):
    from test_convert_cli import WORDS, make_checkpoint, run

    src = make_checkpoint(tmp_path / "src")
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(" ".join(WORDS[i : i + 6]) for i in range(8)) + "\n")
    seen = []
    convert_checkpoint(src, tmp_path / "a", 2, "fit", calib=calib, progress=lambda *a: seen.append(a))
    assert seen == [(1, 2), (2, 2)]
    # On a terminal the command draws a bar on stderr; captured output (not a terminal) gets none.
    result = run(
        "convert", src, tmp_path / "b", "--kv-heads", 2, "--method", "fit", "--calib", calib, "--json"
    )
    assert result.exit_code == 0 and "converting layers" not in result.output
    monkeypatch.setenv("FORCE_COLOR", "1")
    result = run("convert", src, tmp_path / "c", "--kv-heads", 2, "--method", "fit", "--calib", calib)
    assert result.exit_code == 0 and "converting layers (fit)" in result.output and "2/2" in result.output


@pytest.mark.parametrize("case", ["rope", "bert"])
def test_a_shared_copy_keeps_one_copy_of_the_weights_it_leaves(case):
    # attnlab convert held the source in float32 twice (a deep copy) beside a clone of its state: ~8.7x SRC's
    # bytes (a 187 MB bfloat16 checkpoint peaked at 1.9 GB RSS). share=True keeps the unconverted tensors once.
    model = CASES[case]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = padded_batches()
    shared = convert_model(model, 2, "fit", calib=batches, share=True)
    alone = convert_model(model, 2, "fit", calib=batches)
    assert_same_weights(shared, alone)  # the same conversion
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=key)  # the source is untouched
    src = {k: v.data_ptr() for k, v in model.state_dict().items()}
    for name, mine in (("shared", shared), ("alone", alone)):
        same = {k for k, v in mine.state_dict().items() if src.get(k) == v.data_ptr()}
        outside = {k for k in src if ".attention." not in k}
        assert same == (outside if name == "shared" else set()), name
