"""``attnlab convert --to mla``: a native DeepSeek-V3 checkpoint from a Llama-family one, the summary, and the
refusals (one line, exit 2, no destination, source unchanged).

Oracle: transformers' ``DeepseekV3ForCausalLM`` loaded with ``AutoModelForCausalLM`` (no remote code).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from test_convert_cli import calib_file, hf_logits, make_checkpoint, run, tokens, tree_hash  # noqa: F401

from attnlab.convert import convert_model_to_mla, fold_latent_norms
from attnlab.convert.mla_model import choose_stride
from attnlab.hf import convert_checkpoint_to_mla, load_deepseek, load_llama
from attnlab.hf.checkpoint import calibration_batches
from attnlab.hf.mla_checkpoint import STAGES

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """8 heads of 8, 2 KV heads: the rotary keys of two heads cannot both keep RoPE, so the result is approximate."""
    return make_checkpoint(tmp_path_factory.mktemp("mla") / "src", num_key_value_heads=2)


def test_convert_to_mla_writes_a_native_deepseek_checkpoint(tmp_path, source, calib_file):  # noqa: F811
    before = tree_hash(source)
    dst = tmp_path / "dst"
    args = ["--to", "mla", "--kv-lora-rank", 24, "--rope-dim", 4, "--calib", calib_file, "--json"]
    result = run("convert", source, dst, *args)
    assert result.exit_code == 0, result.output
    assert tree_hash(source) == before
    summary = json.loads(result.stdout)
    # The cache of GQA with 2 KV heads of 8 per layer (32 values) becomes 24 latent + 4 rotary values.
    assert summary["kv_values_per_token_before"] == 2 * 2 * 2 * 8
    assert summary["kv_values_per_token_after"] == 2 * (24 + 4)
    assert summary["qk_rope_head_dim"] == 4 and summary["qk_nope_head_dim"] == 8
    assert len(summary["layer_output_error"]) == len(summary["latent_norm_error"]) == 2
    assert summary["files_left_out"] == [] and summary["calibration"] == str(calib_file)

    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["kv_lora_rank"] == 24 and cfg["q_lora_rank"] is None
    assert (dst / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    ours = load_deepseek(dst)
    X = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(X).logits, ours(X), rtol=1e-5, atol=1e-5)
        # The command wrote what the library computes: the plane choice, conversion and latent norm, by hand.
        llama = load_llama(source).float()
        batches = calibration_batches(source, calib_file)
        stride = choose_stride(llama, 4, "norm", calib=batches)
        assert summary["rope_planes"] == [0, stride]
        mla = convert_model_to_mla(llama, 24, 4, calib=batches, planes=stride)
        native, _ = fold_latent_norms(mla, batches)
        # To 1e-5: the same computation in another process. (It was 2e-3 while the latent norm's least squares
        # ran LAPACK's gelsy, whose solutions differed in the last bits from call to call, and the L-BFGS fit
        # after it turned that into ~1e-4 in the logits.)
        torch.testing.assert_close(ours(X), native(X), rtol=1e-5, atol=1e-5)
        # ... and it is an approximation of the source, not something else: closer than a random MLA model.
        src_logits = hf_logits(source, X)
        assert (ours(X) - src_logits).abs().mean() < 0.5 * src_logits.abs().mean()


def test_table_output_names_every_field(tmp_path, source):
    result = run("convert", source, tmp_path / "dst", "--to", "mla", "--kv-lora-rank", 8, "--rope-dim", 2)
    assert result.exit_code == 0, result.output
    assert "MLA (DeepSeek-V3)" in result.stdout
    for field in ("kv_values_per_token_after", "rope_planes", "logits_mla_vs_native", "latent_norm_error"):
        assert field in result.stdout
    assert "random tokens" in result.stdout  # no --calib: said so


def test_progress_reports_every_stage_layer_by_layer(tmp_path, source):
    seen = []
    convert_checkpoint_to_mla(
        source, tmp_path / "dst", 8, 4, progress=lambda stage, done, total: seen.append((stage, done, total))
    )
    # each stage layer by layer (2), then the logits batch by batch (4 batches of random tokens)
    assert seen == [(stage, i, 2) for stage in STAGES[:4] for i in (1, 2)] + [
        (STAGES[4], i, 4) for i in range(1, 5)
    ]


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--kv-lora-rank", 1000, "--rope-dim", 4],
            "--kv-lora-rank must be an int in [1, 32]",
        ),  # 2 KV heads * (8 + 8)
        (["--kv-lora-rank", 0, "--rope-dim", 4], "--kv-lora-rank must be"),
        (["--kv-lora-rank", 16, "--rope-dim", 5], "--rope-dim must be even"),
        (["--kv-lora-rank", 16, "--rope-dim", 10], "--rope-dim must be an int in [2, 8]"),  # head_dim 8
        (["--kv-lora-rank", 16, "--rope-dim", 0], "--rope-dim must be an int in [2, 8]"),
        (
            ["--kv-lora-rank", 16, "--rope-dim", 4, "--planes", 9],
            "--planes 9: a stride must be in [1, 3] for --rope-dim 4",
        ),
        (["--kv-lora-rank", 16, "--planes", "lowest"], "--planes must be one of"),
        # full-width and superscript digits: str.isdigit took "３" as stride 3 and int() refused "²" unnamed
        (["--kv-lora-rank", 16, "--planes", "３"], "--planes must be one of"),
        (["--kv-lora-rank", 16, "--planes", "²"], "--planes must be one of"),
        (["--kv-lora-rank", 16, "--calib", "loop"], "loop: the path does not resolve (Symlink loop"),
        (["--kv-lora-rank", 16, "--kv-heads", 2], "--kv-heads belongs to --to gqa"),
        (["--kv-lora-rank", 16, "--method", "fit"], "--method belongs to --to gqa"),
        (["--rope-dim", 4], "--to mla needs --kv-lora-rank"),
        (["--kv-lora-rank", 16, "--calib", "missing.txt"], "--calib missing.txt: calibration file not found"),
    ],
)
def test_bad_mla_targets_exit_2_with_one_line_and_leave_nothing(tmp_path, source, args, message):
    before = tree_hash(source)
    dst = tmp_path / "dst"
    if "loop" in args:  # a link that points at itself through another: a 62-line traceback
        (tmp_path / "loop").symlink_to(tmp_path / "loop2")
        (tmp_path / "loop2").symlink_to(tmp_path / "loop")
        args = [tmp_path / "loop" if a == "loop" else a for a in args]
        message = f"{tmp_path / message}"
    result = run("convert", source, dst, "--to", "mla", *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab: error:") and message in lines[0], result.output
    assert {p.name for p in tmp_path.iterdir()} <= {"loop", "loop2"}  # no destination, no temporary
    assert tree_hash(source) == before


@pytest.mark.parametrize(
    "args,message",
    [
        (["--kv-heads", 2, "--kv-lora-rank", 16], "--kv-lora-rank belongs to --to mla"),
        (["--kv-heads", 2, "--rope-dim", 4], "--rope-dim belongs to --to mla"),
        (["--kv-heads", 2, "--planes", "norm"], "--planes belongs to --to mla"),
        (["--method", "mean"], "--to gqa needs --kv-heads"),
        (["--to", "mqa", "--kv-heads", 1], "--to must be one of gqa, mla"),
    ],
)
def test_gqa_options_are_not_mixed_with_mla_ones(tmp_path, source, args, message):
    result = run("convert", source, tmp_path / "dst", *args)
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert list(tmp_path.iterdir()) == []


def test_destination_rules_are_the_atomic_writers(tmp_path, source):
    before = tree_hash(source)
    inside = run("convert", source, source / "inner", "--to", "mla", "--kv-lora-rank", 8)
    assert inside.exit_code == 2 and "lies inside the source" in inside.stderr
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("keep")
    exists = run("convert", source, tmp_path / "dst", "--to", "mla", "--kv-lora-rank", 8)
    assert exists.exit_code == 2 and "destination exists" in exists.stderr
    assert (tmp_path / "dst" / "keep.txt").read_text() == "keep"
    assert tree_hash(source) == before


def test_weight_files_the_mla_conversion_did_not_write_are_left_out(tmp_path, source):
    src = tmp_path / "src"
    src.mkdir()
    for f in source.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    (src / "pytorch_model.bin").write_bytes(b"old weights")
    # an uptrained source's summary describes its training, not the MLA model
    (src / "uptrain.json").write_text("{}")
    result = run("convert", src, tmp_path / "dst", "--to", "mla", "--kv-lora-rank", 8, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["files_left_out"] == ["pytorch_model.bin", "uptrain.json"]
    assert "left out of the destination" in result.stderr
    assert not (tmp_path / "dst" / "pytorch_model.bin").exists()


def test_nan_weights_are_refused(tmp_path, source):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    for f in source.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"][0, 0] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    result = run("convert", src, tmp_path / "dst", "--to", "mla", "--kv-lora-rank", 8)
    assert result.exit_code == 2 and "NaN or inf" in result.stderr, result.output
    assert not (tmp_path / "dst").exists()


def test_a_checkpoint_of_mixed_dtypes_keeps_each_tensors_dtype(tmp_path, source):
    """bfloat16 weights with float32 norms (as many published checkpoints hold them): the MLA checkpoint keeps the
    norms in float32, its latent norm too, and its new projections in bfloat16, as the GQA conversion does."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    for f in source.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tensors = {k: v.float() if "norm" in k else v.to(torch.bfloat16) for k, v in tensors.items()}
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    result = run("convert", src, tmp_path / "dst", "--to", "mla", "--kv-lora-rank", 8)
    assert result.exit_code == 0, result.output
    written = load_file(tmp_path / "dst" / "model.safetensors")
    for key, value in written.items():
        want = torch.float32 if "norm" in key else torch.bfloat16
        assert value.dtype == want, key
    assert written["model.layers.0.self_attn.kv_a_layernorm.weight"].dtype == torch.float32
    assert written["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16


def test_an_mlp_bias_is_refused_before_any_work(tmp_path):
    # A QA reproduction: a Llama with mlp_bias=True was refused only when DeepSeek-V3's writer met it, after the
    # whole conversion (a minute on a tiny model; the whole conversion on a real one).
    import time

    from attnlab.families import family
    from attnlab.hf.causal_lm import model_config

    src = make_checkpoint(tmp_path / "src", num_key_value_heads=2, mlp_bias=True)
    assert family("llama").mla(model_config(src)).verdict == "refused"
    started = time.perf_counter()
    result = run("convert", src, tmp_path / "dst", "--to", "mla", "--kv-lora-rank", 8)
    assert result.exit_code == 2 and "mlp_bias=True" in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "dst").exists()
    assert time.perf_counter() - started < 10  # refused before loading the weights


def test_a_window_over_every_position_converts_as_full_attention(tmp_path):
    # Mistral / Phi-3 with sliding_window >= max_position_embeddings (Phi-3-mini-128k: 262144 of 131072) were
    # refused for a window MLA has no field for, though `attnlab families` says they convert
    src = make_checkpoint(tmp_path / "src", num_key_value_heads=2)
    cfg = json.loads((src / "config.json").read_text()) | {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
    }
    written = {}
    for window in (None, 64, 300, 63):  # max_position_embeddings is 64
        (src / "config.json").write_text(json.dumps(cfg | {"sliding_window": window}))
        dst = tmp_path / f"mla-{window}"
        result = run("convert", src, dst, "--to", "mla", "--kv-lora-rank", 8, "--rope-dim", 4)
        if window == 63:
            assert result.exit_code == 2 and "a sliding window of 63 tokens" in result.output, result.output
            assert not dst.exists()
        else:
            assert result.exit_code == 0, result.output
            written[window] = (dst / "model.safetensors").read_bytes()
    assert written[64] == written[300] == written[None]


def test_the_api_names_calibration_that_is_no_list_of_batches(source):
    # a tensor raised "Boolean value of Tensor ... is ambiguous"; [] converted without calibration, silently
    model = load_llama(source)
    for calib, error in ((torch.randint(0, 32, (2, 16)), TypeError), ([], ValueError)):
        with pytest.raises(error, match="calib must be a non-empty list of token batches"):
            convert_model_to_mla(model, 16, 4, calib=calib)
        with pytest.raises(error, match="calib must be a non-empty list of token batches"):
            choose_stride(model, 4, "norm", calib=calib)
