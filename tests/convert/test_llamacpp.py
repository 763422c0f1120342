"""attnlab's conversions in llama.cpp: converted by llama.cpp's own ``convert_hf_to_gguf.py``, loaded, and computing
what attnlab computes (perplexity on the same windows, greedy text, KV cache per token): a Llama and its GQA, MQA
and MLA conversions, and each other family attnlab converts to fewer KV heads (``llamacpp.FAMILY_CASES``).

The round trip needs a llama.cpp build: ``ATTNLAB_LLAMA_CPP=DIR`` names one made by
``python benchmarks/llamacpp_roundtrip.py --build-only`` (DIR = benchmarks/.cache/llamacpp; ``benchmarks/llamacpp.py``
says what it holds). Without it those tests are skipped, saying so. The checks of ``benchmarks/llamacpp.py``'s own
parsing run always.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from attnlab import AttentionConfig, ModelConfig
from attnlab.bench.generate import run_generate
from attnlab.cost import kv_cache_bytes
from attnlab.data import load_stream, load_tokenizer, save_tokenizer, shakespeare, train_byte_bpe
from attnlab.families import REGISTERED
from attnlab.hf import convert_checkpoint, convert_checkpoint_to_mla, save_llama
from attnlab.hf.causal_lm import model_config
from attnlab.model import Transformer
from attnlab.train.evaluate import evaluate_checkpoint

ROOT = Path(__file__).resolve().parents[2]
BUILD = os.environ.get("ATTNLAB_LLAMA_CPP")


@pytest.fixture(scope="module")
def llamacpp():
    """benchmarks/llamacpp.py, loaded as a module."""
    spec = importlib.util.spec_from_file_location("llamacpp_for_tests", ROOT / "benchmarks" / "llamacpp.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_the_declared_pre_tokenizer_is_gpt2_only_for_gpt2s_split(llamacpp, tmp_path):
    tok = train_byte_bpe(["to be or not to be, that is the question"] * 4, 300)
    tok.save(str(tmp_path / "tokenizer.json"))
    assert llamacpp.declared_pre_tokenizer(tmp_path / "tokenizer.json") == "gpt-2"
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    for changed in (
        {
            "pre_tokenizer": spec["pre_tokenizer"] | {"add_prefix_space": True}
        },  # another split of the first word
        {"pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always"}},
        {"normalizer": {"type": "Lowercase"}},
    ):
        (tmp_path / "tokenizer.json").write_text(json.dumps(spec | changed))
        assert llamacpp.declared_pre_tokenizer(tmp_path / "tokenizer.json") is None, changed


def test_kv_cache_line_is_read_per_token(llamacpp):
    # The format of llama_kv_cache's log line (src/llama-kv-cache.cpp, b11434).
    line = (
        "llama_kv_cache: size =    2.00 MiB (  4096 cells,   2 layers,  1/1 seqs), "
        "K (f16):    1.00 MiB, V (f16):    1.00 MiB\n"
    )
    kv = llamacpp.kv_cache("noise\n" + line)
    assert kv["cells"] == 4096 and kv["layers"] == 2 and kv["k_type"] == "f16"
    assert kv["bytes_per_token"] == 512 and kv["bytes_per_token_error"] < 2
    with pytest.raises(ValueError, match="no llama_kv_cache"):
        llamacpp.kv_cache("nothing here")


def test_a_missing_build_is_named(llamacpp, tmp_path):
    with pytest.raises(ValueError, match="--build-only"):
        llamacpp.locate(tmp_path)


# ---- the round trip (needs the build) --------------------------------------------------------------------------

WINDOW = 256  # llama.cpp pads its context to a multiple of 256: the window it scores must be one


def _source(path: Path) -> tuple[Path, Path]:
    """A small Llama (4 heads of 16, 2 layers) with weights far enough from zero that greedy choices are clear, a
    byte-level BPE trained on a play, and a held-out text of another play."""
    plays = sorted(shakespeare().glob("*.txt"))
    tok = train_byte_bpe([plays[0].read_text()[:200_000]], 384)
    cfg = ModelConfig(384, 2, AttentionConfig(d_model=64, n_heads=4), 128, max_seq_len=WINDOW)
    model = Transformer(cfg)
    model.init_weights(std=0.15, seed=3)
    src = save_llama(model, path / "src", base_config={"bos_token_id": 0, "eos_token_id": 0})
    save_tokenizer(tok, src)
    text = path / "text.txt"
    body = plays[1].read_text()[:30_000]
    text.write_text(body[: body.rfind("\n") + 1])
    return src, text


NO_BUILD = (
    "ATTNLAB_LLAMA_CPP is not set: build llama.cpp with `python benchmarks/llamacpp_roundtrip.py --build-only` and "
    "set ATTNLAB_LLAMA_CPP=benchmarks/.cache/llamacpp"
)


@pytest.mark.skipif(not BUILD, reason=NO_BUILD)
@pytest.mark.usefixtures("one_thread")  # llama.cpp runs on one thread too
def test_conversions_run_in_llamacpp_as_in_attnlab(llamacpp, tmp_path):
    build = llamacpp.locate(BUILD)  # set but incomplete: fails, naming what is missing
    src, text = _source(tmp_path)
    convert_checkpoint(src, tmp_path / "gqa", 2, "mean")
    convert_checkpoint(src, tmp_path / "mqa", 1, "mean")
    convert_checkpoint_to_mla(src, tmp_path / "mla", 24, 8, calib=text)  # nope 16, rope 8: cache 32 values
    # from one KV head with every dim rotary: no nope part, so one zero dim is written (llama.cpp needs one)
    summary = convert_checkpoint_to_mla(tmp_path / "mqa", tmp_path / "mla1", 16, 16, calib=text)
    assert summary["qk_nope_head_dim"] == 1
    body = text.read_text()
    prompt = body[1000 : 1000 + body[1000:].find("\n", 100)]
    latent = {"mla": 24 + 8, "mla1": 16 + 16}
    for name in ("src", "gqa", "mqa", "mla", "mla1"):
        ckpt = tmp_path / name
        gguf = tmp_path / f"{name}.gguf"
        added = llamacpp.to_gguf(build, ckpt, gguf, "f32")["added"]
        assert any("pre-tokenizer 'gpt-2'" in note for note in added), added
        if name == "src":  # one tokenizer for all: llama.cpp's ids of the whole text are attnlab's
            assert llamacpp.tokenize(build, gguf, text) == load_stream(ckpt, text, 1).tokens.tolist()
        ours = evaluate_checkpoint(ckpt, text, seq_len=WINDOW - 1)
        theirs = llamacpp.perplexity(build, gguf, text, WINDOW, threads=1, float32=True)
        assert theirs["windows"] == ours["windows"], name
        assert abs(theirs["perplexity"] - ours["perplexity"]) <= 1e-4 * ours["perplexity"], name
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("builtins.print", lambda *a, **k: None)  # run_generate prints its JSON
            gen = run_generate(
                ckpt, [prompt], max_new=32, temperature=0.0, top_k=None, top_p=None, seed=0, stop=[],
                ignore_eos=False, dtype="fp32", as_json=True,
            )["outputs"][0]  # fmt: skip
        done = llamacpp.complete(
            build, gguf, prompt, 32, 4096, threads=1, float32=True
        )  # 4096 cells: exact MiB
        assert done["prompt_ids"] == load_tokenizer(ckpt).encode(prompt).ids, name  # no BOS added either
        assert (done["text"], done["stopped"]) == (gen["text"], gen["stopped"]), name
        cfg = model_config(ckpt)
        kv = done["kv_cache"]
        assert (
            abs(kv["bytes_per_token"] - kv_cache_bytes(cfg, 1, 1, torch.float32))
            <= kv["bytes_per_token_error"]
        )
        if name in latent:  # the latent cache: (kv_lora_rank + rope_dim) values per token and layer, K only
            assert kv["bytes_per_token"] / 4 / kv["layers"] == pytest.approx(latent[name], abs=0.5)
            assert kv["v_mib"] == 0


# ---- every other family attnlab converts -----------------------------------------------------------------------

# the causal-LM families whose KV heads attnlab converts (the Llama one is the test above)
CONVERTED = [f.name for f in REGISTERED if f.causal_lm and f.gqa is not None and f.name != "llama"]


def test_every_converted_family_has_a_llamacpp_case(llamacpp):
    cases = {case.family for case in llamacpp.FAMILY_CASES.values()}
    assert cases == set(CONVERTED)


@pytest.fixture(scope="module")
def family_text(tmp_path_factory) -> tuple[object, Path, str]:
    """(a byte-level BPE, a short held-out text, a prompt from it)."""
    plays = sorted(shakespeare().glob("*.txt"))
    tok = train_byte_bpe([plays[0].read_text()[:100_000]], 320)
    text = tmp_path_factory.mktemp("text") / "text.txt"
    body = plays[1].read_text()[:6000]
    text.write_text(body[: body.rfind("\n") + 1])
    return tok, text, body[1000 : 1000 + body[1000:].find("\n", 100)]


@pytest.mark.skipif(not BUILD, reason=NO_BUILD)
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", CONVERTED)
def test_family_conversions_run_in_llamacpp_as_in_attnlab(llamacpp, family_text, name, tmp_path):
    build = llamacpp.locate(BUILD)
    tok, text, prompt = family_text
    case = llamacpp.FAMILY_CASES[name]
    src = llamacpp.family_checkpoint(case, tmp_path / "src", tok, WINDOW)
    # the KV heads attnlab can lose: 1 of 2, or of GPT-NeoX's 4 heads 2 (its MHA layout repeats them)
    n_kv = model_config(src).attention.n_kv_heads
    summary = convert_checkpoint(src, tmp_path / "gqa", 1 if n_kv < 4 else 2, "mean")
    if case.refused:  # llama.cpp's converter takes no checkpoint of this family (FamilyCase.note says why)
        with pytest.raises(RuntimeError, match=case.refused):
            llamacpp.to_gguf(build, tmp_path / "gqa", tmp_path / "gqa.gguf", "f32")
        return
    assert summary["n_kv_heads_after"] < summary["n_kv_heads_before"], summary
    got = llamacpp.round_trip(build, tmp_path / "gqa", text, prompt, WINDOW, 32)
    assert got["tokens_equal"] and got["prompt_ids_equal"], got
    assert got["windows"][0] == got["windows"][1] > 0, got
    assert got["ppl_rel_diff"] <= 1e-4, got  # llama-perplexity prints 4 decimals: ~1e-7 of these
    assert got["greedy_equal"] and got["greedy_tokens"] == 32, got
