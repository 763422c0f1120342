"""`attnlab compare`: JSON schema and values, the PNG plot, --measure, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.cost import kv_cache_bytes
from attnlab.cost.presets import HF_CONFIGS, get_preset

runner = CliRunner()

ROW_KEYS = {
    "variant": str, "n_kv_heads": int, "native": bool, "kv_cache_bytes_per_token": int, "attention_params": int,
    "prefill_flops": int, "decode_step_seconds": float, "max_batch": int,
}  # fmt: skip


def run_json(*args: str) -> dict:
    result = runner.invoke(app, ["compare", *args, "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_compare_json_default_is_llama_2_7b_on_h100():
    doc = run_json()
    assert (doc["model"], doc["hardware"], doc["dtype"], doc["batch"], doc["seq_len"]) == (
        "llama-2-7b",
        "h100",
        "bf16",
        1,
        4096,
    )
    for row in doc["rows"]:
        for key, kind in ROW_KEYS.items():
            assert isinstance(row[key], kind), (key, row[key])
        assert row["variant"] in {"mha", "mqa", "gqa", "mla"}
        assert row["decode_step_seconds"] > 0 and row["prefill_flops"] > 0
    assert [r["n_kv_heads"] for r in doc["rows"]] == [32, 16, 8, 4, 2, 1, 1]
    assert [r["variant"] for r in doc["rows"] if r["native"]] == ["mha"]
    assert doc["rows"][0]["kv_cache_bytes_per_token"] == 512 * 1024
    by_heads = [r["decode_step_seconds"] for r in doc["rows"][:6]]
    assert by_heads == sorted(by_heads, reverse=True)  # fewer KV heads: less to read per step
    assert [r["max_batch"] for r in doc["rows"][:6]] == sorted(r["max_batch"] for r in doc["rows"][:6])
    assert "llama-2-7b" in doc["verdict"]


def test_compare_json_deepseek_v3_and_options():
    doc = run_json(
        "--model", "deepseek-v3", "--seq-len", "1000", "--batch", "2", "--hardware", "h200", "--dtype", "fp8"
    )
    mla = [r for r in doc["rows"] if r["native"]]
    assert len(mla) == 1 and mla[0]["variant"] == "mla" and mla[0]["kv_cache_bytes_per_token"] == 35_136
    assert mla[0]["kv_cache_bytes"] == kv_cache_bytes(get_preset("deepseek-v3"), 2, 1000, "fp8")
    assert doc["hardware"] == "h200" and mla[0]["max_batch"] == 0  # 671 GB of fp8 weights > 141 GB


def test_compare_config_json_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_CONFIGS["gpt2"]))
    doc = run_json("--model", str(path), "--seq-len", "1024")
    assert [r["variant"] for r in doc["rows"] if r["native"]] == ["mha"]
    assert doc["rows"][0]["kv_cache_bytes_per_token"] == 2 * 12 * 768 * 2


@pytest.mark.parametrize(
    ("preset", "config_class"), [("gemma-3-1b", "Gemma3TextConfig"), ("mistral-7b", "MistralConfig")]
)
def test_compare_counts_a_sliding_layer_at_its_window_and_says_so(preset, config_class):
    """Issue 30: a sliding layer caches min(window, tokens). Which layers slide is transformers' own reading of the
    preset's config.json; past the window the native KV cache is that count, and the table says why it is less
    than KV bytes/token x tokens."""
    import transformers

    hf = HF_CONFIGS[preset]
    theirs = getattr(transformers, config_class)(**{k: v for k, v in hf.items() if k != "model_type"})
    types = getattr(theirs, "layer_types", None) or ["sliding_attention"] * theirs.num_hidden_layers
    window, seq_len = theirs.sliding_window, 4 * theirs.sliding_window
    per_layer_token = 2 * theirs.num_key_value_heads * theirs.head_dim * 2  # bf16 keys and values
    tokens = sum(min(window, seq_len) if t == "sliding_attention" else seq_len for t in types)
    doc = run_json("--model", preset, "--seq-len", str(seq_len))
    native = next(r for r in doc["rows"] if r["native"])
    assert native["kv_cache_bytes"] == per_layer_token * tokens < native["kv_cache_bytes_per_token"] * seq_len
    sliding = types.count("sliding_attention")
    assert (doc["sliding_layers"], doc["n_layers"], doc["window"]) == (sliding, len(types), window)
    mla = next(r for r in doc["rows"] if r["variant"] == "mla")  # DeepSeek-V3 has no window: every token
    assert mla["kv_cache_bytes"] == mla["kv_cache_bytes_per_token"] * seq_len
    table = runner.invoke(app, ["compare", "--model", preset, "--seq-len", str(seq_len)], terminal_width=400)
    text = " ".join(table.stdout.split())
    assert f"{sliding} of {len(types)} layers attend to the last {window} tokens" in text
    assert f"cache {window:,} of the {seq_len:,}" in text


def test_compare_of_a_model_without_windows_says_nothing_of_them():
    doc = run_json("--model", "llama-2-7b")
    assert (doc["sliding_layers"], doc["window"]) == (0, None)
    assert "Sliding window" not in runner.invoke(app, ["compare"], terminal_width=400).stdout


def test_compare_table_and_plot(tmp_path):
    import matplotlib.image

    out = tmp_path / "cmp.png"
    result = runner.invoke(app, ["compare", "--model", "llama-3-8b", "--plot", str(out)])
    assert result.exit_code == 0, result.stderr
    assert "gqa-8 *" in result.stdout and "max batch" in result.stdout and "llama-3-8b" in result.stdout
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (480, 1200)  # 12 x 4.8 inches at 100 dpi
    assert image.std() > 0.05  # not blank
    assert [p.name for p in tmp_path.iterdir()] == ["cmp.png"]  # no temp file left


def test_compare_measure_small_model(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            dict(HF_CONFIGS["llama-2-7b"], hidden_size=256, num_attention_heads=4, num_key_value_heads=4)
        )
    )
    result = runner.invoke(app, ["compare", "--model", str(path), "--seq-len", "512", "--hardware", "local",
                                 "--dtype", "fp32", "--json", "--measure"])  # fmt: skip
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert (
        [m["variant"] for m in doc["measured"]]
        == [r["label"] for r in doc["rows"]]
        == ["mha", "gqa-2", "mqa", "mla"]
    )
    for m in doc["measured"]:
        assert m["measured_seconds"] > 0 and m["predicted_seconds"] > 0
        assert m["ratio"] == pytest.approx(m["measured_seconds"] / m["predicted_seconds"])


def test_compare_measure_times_a_sliding_window_layer_over_its_window(tmp_path):
    """Mistral's layers read at most their window: --measure timed and priced a full-attention layer over every
    token (at 10^6 tokens it refused the layer as too large to time)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(HF_CONFIGS["llama-2-7b"], model_type="mistral", sliding_window=64,
                                    hidden_size=256, num_attention_heads=4, num_key_value_heads=4)))  # fmt: skip
    result = runner.invoke(app, ["compare", "--model", str(path), "--seq-len", "512", "--hardware", "local",
                                 "--dtype", "fp32", "--json", "--measure"])  # fmt: skip
    assert result.exit_code == 0, result.stderr
    measured = {m["variant"]: m for m in json.loads(result.stdout)["measured"]}
    mha = measured["mha"]
    # which layer was timed, over how many tokens (Gemma 2's half-and-half took the sliding one unsaid)
    assert (mha["layer"], mha["tokens"]) == ("sliding window 64", 64)
    assert (measured["mla"]["layer"], measured["mla"]["tokens"]) == ("latent", 512)
    # by hand: q, k, v, o of 256 x 256 (524,288 FLOPs, 1 MiB of fp32) and 4 heads of 64 over the window's 64 keys
    # (scores and values: 4 x 64 x 64 x 2 x 2 = 65,536 FLOPs; K and V: 2 x 4 x 64 x 64 x 4 = 131,072 bytes)
    assert (mha["flops"], mha["bytes"]) == (524_288 + 65_536, 2**20 + 131_072)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "llama-2"], "unknown model preset"),
        (["--model", "nowhere/config.json"], "no config.json at"),
        (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
        (["--batch", "-3"], "--batch must be >= 1, got -3"),
        (["--hardware", "tpu"], "--hardware 'tpu' is not known"),
        (["--dtype", "fp5"], "dtype 'fp5' is not known"),
        (["--seq-len", str(2**41)], "--seq-len must be <= 2**40"),
        (["--plot", "plot.jpg"], "give a file name ending in .png"),
        (
            ["--measure", "--model", "llama-3.1-405b", "--batch", "64", "--seq-len", "131072"],
            "too large to time",
        ),
    ],
)
def test_compare_errors_are_one_line_exit_2(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["compare", *args])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab: error:") and message in lines[0], result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_key_value_heads=5), "num_key_value_heads=5 does not divide num_attention_heads=32"),
        # Issue 8: a hidden_size the heads do not divide was accepted by compare.
        (
            dict(hidden_size=4095),
            "hidden_size=4095 is not divisible by num_attention_heads=32 and head_dim is not given",
        ),
    ],
)
def test_bad_config_json_exit_2(tmp_path, change, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(HF_CONFIGS["llama-2-7b"], **change)))
    result = runner.invoke(app, ["compare", "--model", str(path)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"attnlab: error: {path}: {message}"  # the file, not "llama config.json"


def test_a_quantized_config_is_costed_at_the_dtype_and_says_so_and_its_weights_are_refused(tmp_path):
    """compare counts a quantized checkpoint's weights at --dtype, which it says on stderr (never silently); a
    command that loads the weights refuses them, naming the field."""
    from attnlab.hf.io import read_config

    gptq = dict(HF_CONFIGS["llama-2-7b"], quantization_config={"quant_method": "gptq", "bits": 4})
    (tmp_path / "config.json").write_text(json.dumps(gptq))
    result = runner.invoke(app, ["compare", "--model", str(tmp_path / "config.json"), "--json"])
    assert result.exit_code == 0, result.output
    plain = runner.invoke(app, ["compare", "--model", "llama-2-7b", "--json"])
    got, want = json.loads(result.stdout), json.loads(plain.stdout)
    assert got["rows"] == want["rows"] and got["weight_bytes"] == want["weight_bytes"]
    assert result.stderr.strip() == (
        f"note: {tmp_path / 'config.json'} is quantized (gptq); its weights are counted at --dtype bf16, "
        "not as stored"
    )
    assert plain.stderr == ""
    with pytest.raises(ValueError, match=r"quantization_config \(gptq\): attnlab reads unquantized weights"):
        read_config(tmp_path)


def test_a_context_beyond_the_models_positions_is_costed_and_said():
    result = runner.invoke(app, ["compare", "--model", "gpt2", "--seq-len", "8192", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["seq_len"] == 8192
    assert result.stderr.strip() == (
        "note: --seq-len 8192 is beyond the model's 1024 positions (max_position_embeddings); the figures are what "
        "such a context would cost"
    )
    assert runner.invoke(app, ["compare", "--model", "gpt2", "--seq-len", "1024"]).stderr == ""


def test_a_split_of_q_k_norms_is_priced_and_said():
    # apply_tp refuses q/k norms; compare priced their split without a word (and for OLMo 2's norm over all heads
    # without the collectives its statistics need)
    full = runner.invoke(app, ["compare", "--model", "olmo-2-7b", "--tp", "4", "--json"])
    assert full.exit_code == 0, full.output
    assert "apply_tp does not do yet (qk_norm='full'); a norm over all heads needs" in full.stderr
    head = runner.invoke(app, ["compare", "--model", "qwen3-8b", "--tp", "4"])
    assert "(qk_norm='head')" in head.stderr and "a norm over all heads" not in head.stderr
    assert runner.invoke(app, ["compare", "--model", "qwen3-8b"]).stderr == ""
    assert runner.invoke(app, ["compare", "--model", "llama-3-8b", "--tp", "4"]).stderr == ""


def test_a_layer_count_no_model_has_is_refused_at_once(tmp_path):
    # a million layers hung compare, eval and convert (each builds or costs the model layer by layer)
    import time

    cfg = HF_CONFIGS["llama-3-8b"] | {"num_hidden_layers": 1_000_000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    start = time.monotonic()
    result = runner.invoke(app, ["compare", "--model", str(tmp_path)])
    assert result.exit_code == 2 and time.monotonic() - start < 10
    assert "field 'num_hidden_layers' must be in [1, 4096], got 1000000" in result.output


def test_a_terminal_gets_no_highlighted_numbers(monkeypatch):
    # on a terminal Rich's highlighter bolded and coloured the digits inside prose and table cells ("8.<ESC>0x"),
    # which NO_COLOR (colour only) left in; styles are the table's own now (a bold header)
    monkeypatch.setenv("FORCE_COLOR", "1")  # what a terminal gets
    result = runner.invoke(app, ["compare"])
    assert result.exit_code == 0 and "\x1b[1m" in result.stdout  # a terminal's output, styled
    assert not re.search(r"\x1b\[[0-9;]*m[0-9.,]+\x1b", result.stdout), result.stdout
