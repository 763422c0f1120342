"""Tensor parallelism in the cost model: per-rank KV bytes from the head counts, replication, the all-reduces and
their time on the interconnect, ``attnlab compare --tp`` (and ``--devices``, its old name), and docs/parallel.md
being what benchmarks/tp_table.py computes. (The per-rank figures against real sharded modules under torchrun are
in tests/train/test_tensor_parallel.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.config import AttentionConfig, ModelConfig
from attnlab.cost import (
    compare,
    get_hardware,
    get_preset,
    kv_cache_bytes,
    model_param_count,
    param_count,
    roofline,
)
from attnlab.cost.parallel import (
    allreduce_bytes_per_token_per_layer,
    kv_heads_per_rank,
    kv_replicas,
    rank_config,
    tp_comm,
)

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def kv_per_token_per_rank(name: str, tp: int) -> int:
    return kv_cache_bytes(rank_config(get_preset(name), tp), 1, 1, "bf16")


def test_llama_2_70b_per_rank_kv_bytes_from_its_head_counts():
    # 80 layers, 64 query heads, 8 KV heads of head_dim 128, bf16: a KV head costs 2 x 128 x 2 = 512 bytes a layer.
    cfg = get_preset("llama-2-70b").attention
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (64, 8, 128)
    assert kv_per_token_per_rank("llama-2-70b", 1) == 80 * 8 * 512 == 327_680
    assert kv_per_token_per_rank("llama-2-70b", 8) == 80 * 1 * 512 == 40_960  # one KV head per rank
    # tp 16: 4 query heads per rank, all reading one KV head that 2 ranks hold: no saving past tp 8
    assert (kv_heads_per_rank(cfg, 16), kv_replicas(cfg, 16)) == (1, 2)
    assert kv_per_token_per_rank("llama-2-70b", 16) == 40_960 == 2 * 327_680 // 16


def test_deepseek_v3_caches_the_whole_latent_on_every_rank():
    cfg = get_preset("deepseek-v3").attention
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (512, 64)
    whole = 61 * (512 + 64) * 2
    assert kv_per_token_per_rank("deepseek-v3", 1) == whole == 70_272
    for tp in (8, 16, 32):
        assert kv_per_token_per_rank("deepseek-v3", tp) == whole and kv_replicas(cfg, tp) == tp


def test_rank_config_splits_heads_mlp_and_vocab_and_replicates_the_rest():
    model = get_preset("llama-3-8b")  # 32 heads, 8 KV heads, ffn 14336, vocab 128256, untied
    local = rank_config(model, 8)
    assert (local.n_heads, local.attention.n_kv_heads, local.attention.head_dim) == (4, 1, 128)
    assert (local.ffn_dim, local.vocab_size, local.d_model) == (14336 // 8, 128256 // 8, 4096)
    # Without replicated KV heads, MHA/GQA weights split exactly: tp ranks hold the whole but its norms tp times
    norms = (2 * model.n_layers + 1) * model.d_model
    assert 8 * (model_param_count(local) - norms) + norms == model_param_count(model)
    # MLA: the latent path (wkv_a, kv_norm) and q_lora path (wq_a, q_norm) stay whole on every rank
    v3 = get_preset("deepseek-v3")
    a, la = v3.attention, rank_config(v3, 8).attention
    assert (la.n_heads, la.kv_lora_rank, la.q_lora_rank) == (16, 512, 1536)
    replicated = a.d_model * a.q_lora_rank + a.q_lora_rank + a.d_model * a.cache_dim + a.kv_lora_rank
    assert param_count(la) - replicated == (param_count(a) - replicated) // 8
    # sizes tp does not divide: the largest share, as torch.chunk gives the first ranks
    odd = ModelConfig(vocab_size=97, n_layers=1, attention=AttentionConfig(d_model=32, n_heads=4), ffn_dim=90)
    assert (rank_config(odd, 4).vocab_size, rank_config(odd, 4).ffn_dim) == (25, 23)
    assert rank_config(odd.replace(tie_embeddings=True), 4).vocab_size == 97  # a tied table stays whole


def test_all_reduce_payload_and_ring_time_on_nvlink_and_across_nodes():
    model, h100 = get_preset("llama-2-70b"), get_hardware("h100")
    assert allreduce_bytes_per_token_per_layer(model, "bf16") == 2 * 8192 * 2  # attention and MLP outputs
    # weights stored in int4 / int8 / fp6 compute in bf16: the activations sent are bf16 (int4 once sent a quarter)
    for stored in ("int4", "int8", "fp6"):
        assert allreduce_bytes_per_token_per_layer(model, stored) == 2 * 8192 * 2
        assert tp_comm(model, get_hardware("h100"), 8, tokens=1, sampled=1, dtype=stored) == tp_comm(
            model, get_hardware("h100"), 8, tokens=1, sampled=1, dtype="bf16"
        )
    # fp8 on an A100, which has no fp8 rate, computes (and sends) bf16 as compute_peak has it; an H100 sends fp8
    a100 = get_hardware("a100-80gb")
    assert allreduce_bytes_per_token_per_layer(model, "fp8", a100) == 2 * 8192 * 2
    assert tp_comm(model, a100, 8, tokens=1, sampled=1, dtype="fp8") == tp_comm(
        model, a100, 8, tokens=1, sampled=1, dtype="bf16"
    )
    assert allreduce_bytes_per_token_per_layer(model, "fp8", h100) == 2 * 8192
    one = tp_comm(model, h100, 8, tokens=1, sampled=1, dtype="bf16")
    assert one.collectives == 2 * 80 + 2  # per layer two, the embedding's all-reduce, the logits' all-gather
    assert one.allreduce_bytes == (2 * 80 + 1) * 8192 * 2 and one.allgather_bytes == 32000 * 2
    assert one.link_bandwidth == 450e9  # NVLink 4: 900 GB/s both directions
    assert one.seconds == pytest.approx(
        (2 * 7 / 8 * one.allreduce_bytes + 7 / 8 * one.allgather_bytes) / 450e9
    )
    across = tp_comm(model, h100, 16, tokens=1, sampled=1, dtype="bf16")
    assert across.link_bandwidth == 50e9  # 16 ranks span two 8-GPU nodes: one 400 Gb/s port per GPU
    assert tp_comm(model, h100, 1, tokens=1, sampled=1).seconds == 0.0
    with pytest.raises(ValueError, match="no interconnect figures"):
        tp_comm(
            model,
            get_hardware("h100").__class__(**{**vars(h100), "link_bandwidth": None}),
            2,
            tokens=1,
            sampled=1,
        )


def test_roofline_per_rank_adds_the_interconnect_to_each_phase():
    model = get_preset("llama-2-70b")
    r = roofline(model, "h100", tp=8)
    local = rank_config(model, 8)
    assert r.kv_cache_bytes == kv_cache_bytes(local, 1, 4096) and r.memory_bytes == int(79.2 * 2**30)
    assert r.decode.seconds == pytest.approx(
        max(r.decode.compute_seconds, r.decode.memory_seconds) + r.decode.comm_seconds
    )
    assert r.decode.comm_seconds > 0 and roofline(model, "h100").decode.comm_seconds == 0
    assert roofline(model, "rtx4090", tp=8).decode.bound == "memory"
    # on PCIe (32 GB/s a direction) a long prefill waits on its all-reduces more than on its weights
    assert (
        roofline(model, "l40s", tp=8, seq_len=4096).prefill.comm_seconds
        > roofline(model, "h100", tp=8).prefill.comm_seconds
    )


def test_compare_skips_variants_whose_kv_heads_do_not_split_and_refuses_a_native_one():
    qwen = get_preset("qwen2-7b")  # 28 query heads, 4 KV heads
    c = compare(qwen, tp=4)
    assert set(c.skipped) == {"gqa-14", "gqa-7"}
    assert "tp=4 must divide n_kv_heads=14" in c.skipped["gqa-14"]
    assert {r.label for r in c.rows} == {"mha", "gqa-4", "gqa-2", "mqa", "mla"}
    with pytest.raises(ValueError, match="tp=7 must divide n_kv_heads=4"):
        compare(qwen, tp=7)
    with pytest.raises(ValueError, match="tp=3 must divide n_heads=28"):
        compare(qwen, tp=3)


def test_compare_rows_at_tp_1_have_per_rank_fields_equal_to_the_totals():
    for r in compare(get_preset("llama-3-8b")).rows:
        assert r.kv_cache_bytes_per_token_per_rank == r.kv_cache_bytes_per_token
        assert r.kv_cache_bytes_per_rank == r.kv_cache_bytes and r.kv_replicas == 1
        assert r.allreduce_bytes_per_token_per_layer == 0 and r.decode_comm_seconds == 0


def compare_json(*args: str) -> tuple[int, dict | str]:
    result = runner.invoke(app, ["compare", *args, "--json"])
    return result.exit_code, json.loads(result.stdout) if result.exit_code == 0 else result.stderr


def test_compare_cli_tp_json_has_the_per_rank_fields_and_devices_is_its_other_name():
    code, doc = compare_json("--model", "llama-2-70b", "--tp", "16")
    assert code == 0 and doc["tp"] == 16 and doc["skipped"] == {} and doc["collectives_per_step"] == 162
    native = next(r for r in doc["rows"] if r["native"])
    assert (native["kv_heads_per_rank"], native["kv_replicas"]) == (1, 2)
    assert (
        native["kv_cache_bytes_per_token_per_rank"] == 40_960
        and native["kv_cache_bytes_per_token"] == 327_680
    )
    assert native["allreduce_bytes_per_token_per_layer"] == 32_768
    assert compare_json("--model", "llama-2-70b", "--devices", "16") == (0, doc)
    for args, message in (
        (("--devices", "8", "--tp", "4"), "--devices 8 and --tp 4 disagree"),
        (("--tp", "3"), "--tp 3 must divide the model's 32 query heads"),
        (("--tp", "2", "--hardware", "local"), "--hardware local and --measure are one process"),
        (("--tp", "0"), "--tp must be >= 1"),
        # an error names the option the user gave (--devices 0 was reported as "--tp must be >= 1")
        (("--devices", "0"), "--devices must be >= 1"),
        (("--devices", "3"), "--devices 3 must divide the model's 32 query heads"),
        (("--devices", "2", "--hardware", "local"), "--devices models GPUs"),
    ):
        code, err = compare_json(*args)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (args, err)
    for flag in ("--tp", "--devices"):  # the note names the option given too
        result = runner.invoke(app, ["compare", "--model", "qwen3-8b", flag, "2", "--json"])
        assert (
            result.exit_code == 0
            and f"note: {flag} 2 prices q/k norms split with their heads" in result.stderr
        )


def test_compare_cli_table_shows_kv_heads_per_rank_and_replicas():
    result = runner.invoke(app, ["compare", "--model", "llama-2-70b", "--tp", "16"])
    assert result.exit_code == 0, result.stderr
    native = next(line for line in result.stdout.splitlines() if line.startswith("gqa-8 *"))
    assert "1 x2" in native and "327,680" in native and "40,960" in native
    assert "per rank of tp=16" in result.stdout


def test_docs_parallel_page_is_what_the_cost_model_computes(tmp_path):
    doc, data = tmp_path / "parallel.md", tmp_path / "tp_table.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tp_table.py"), "--doc", str(doc), "--json", str(data)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert doc.read_text() == (ROOT / "docs" / "parallel.md").read_text()
    assert json.loads(data.read_text()) == json.loads(
        (ROOT / "benchmarks" / "results" / "tp_table.json").read_text()
    )
    rows = {(r["model"], r["tp"]): r for r in json.loads(data.read_text())["rows"]}
    assert rows[("llama-2-70b", 16)]["kv_bytes_per_token_per_rank"] == kv_per_token_per_rank(
        "llama-2-70b", 16
    )
    assert rows[("deepseek-v3", 8)]["kv_bytes_per_token_per_rank"] == 70_272
