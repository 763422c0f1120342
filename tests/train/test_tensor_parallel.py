"""Tensor parallelism by heads (``attnlab.parallel.apply_tp``) under ``torchrun`` with gloo on CPU, against the
unsharded modules in one process; and the cost model's per-rank figures against what the sharded modules hold.

One launch of ``tp_worker.py`` on 2 ranks (and one on 4) runs every distributed check; the tests below read its
record. The 2-rank launch splits KV heads for MHA and GQA-4 and replicates them for MQA; the 4-rank one also
replicates GQA-2's (a (kv, rep) = (2, 2) view of the mesh) and runs uptraining as 2 data-parallel replicas of
tp 2 (FSDP2 over "dp"). Both also shard MQA, GQA-2 and MLA over a mesh without dimension names and over the "tp"
dimension of a 2-D mesh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tp_worker import ATTENTION, MESH_MODULES, MLP_DIMS, MODELS
from train_helpers import make_llama, run_cli

from attnlab.config import MLAConfig, ModelConfig
from attnlab.cost import kv_cache_bytes, model_param_count, param_count
from attnlab.cost.parallel import check_tp, kv_heads_per_rank, rank_config
from attnlab.cost.params import mlp_param_count
from attnlab.parallel import check_shardable
from attnlab.train import UptrainOptions, distributed, uptrain

WORKER = Path(__file__).with_name("tp_worker.py")
ENV = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
SIZES = (2, 4)


@pytest.fixture(scope="module")
def kv1_llama(tmp_path_factory, tokenizer) -> Path:
    """The tiny Llama with one KV head: at tp 2 that head is replicated, the harder case to train."""
    return make_llama(tmp_path_factory.mktemp("kv1") / "src", tokenizer, num_key_value_heads=1)


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"{n}ranks")
def record(request, tmp_path_factory, kv1_llama, corpus) -> dict:
    n = request.param
    work = tmp_path_factory.mktemp(f"tp{n}")
    out = work / "record.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), str(WORKER),
           str(out), str(kv1_llama), str(corpus), str(work)]  # fmt: skip
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, "\n".join(line for line in done.stderr.splitlines() if "[rank" in line)[
        -6000:
    ]
    return json.loads(out.read_text())


def one_layer(cfg) -> ModelConfig:
    return ModelConfig(vocab_size=8, n_layers=1, attention=cfg, ffn_dim=8)


def assert_equals_unsharded(got: dict) -> None:
    assert got["forward"] < 1e-5 and got["input_grad"] < 1e-5, got
    assert got["weight_grad"] < 1e-5, got  # relative to each weight's largest gradient
    assert got["pending_grads"] == [], got  # replicated weights' partial gradients were summed
    assert got["decode"] < 1e-5 and got["decode_vs_forward"] < 1e-5, got


@pytest.mark.parametrize("name", list(ATTENTION))
def test_sharded_attention_equals_unsharded_forward_backward_and_cached_decode(record, name):
    assert_equals_unsharded(record["modules"][name])


@pytest.mark.parametrize("name", list(ATTENTION))
def test_each_rank_caches_its_kv_heads_and_the_cost_model_says_how_many_bytes(record, name):
    tp = record["world_size"]
    assert_holds_its_share(record["modules"][name], ATTENTION[name], tp, tp)


def assert_holds_its_share(got: dict, cfg, tp: int, world: int) -> None:
    """Each of the ``world`` ranks holds and caches one rank's share of ``tp``."""
    local = rank_config(one_layer(cfg), tp)
    assert got["cache_bytes"] == [kv_cache_bytes(local, 2, 7, "fp32")] * world
    assert got["local_params"] == [param_count(local.attention)] * world
    mla = isinstance(cfg, MLAConfig)  # no KV heads: every rank caches the whole latent
    assert got["heads"] == [[cfg.n_heads // tp, None if mla else kv_heads_per_rank(cfg, tp)]] * world
    if (
        mla or kv_heads_per_rank(cfg, tp) * tp > cfg.n_kv_heads
    ):  # replicated: one KV head (or the latent) each
        whole = kv_cache_bytes(one_layer(cfg), 2, 7, "fp32")
        assert got["cache_bytes"][0] == (whole if mla else whole // cfg.n_kv_heads)


@pytest.mark.parametrize("mesh", ["unnamed", "tp-of-2d"])
@pytest.mark.parametrize("name", MESH_MODULES)
def test_any_1d_mesh_a_user_makes_shards_like_the_named_one(record, mesh, name):
    """A mesh without dimension names (init_device_mesh("cpu", (n,))), and mesh["tp"] of a 2-D ("dp", "tp") mesh:
    MQA (its KV head on every rank), GQA-2 (on 4 ranks a (kv, rep) = (2, 2) view of the unnamed mesh) and MLA
    equal the unsharded module, and each rank holds its share."""
    got, world = record["meshes"][mesh], record["world_size"]
    tp = world if mesh == "unnamed" else 2
    assert got["tp"] == tp
    # the 2-D mesh's "tp" slices: (0, 1) on 2 ranks; (0, 1) and (2, 3) on 4, so one rank's mesh is not all ranks
    assert got["ranks"] == [[r - r % tp + i for i in range(tp)] for r in range(world)]
    assert_equals_unsharded(got[name])
    assert_holds_its_share(got[name], ATTENTION[name], tp, world)


@pytest.mark.parametrize("name", list(ATTENTION))
def test_a_mask_for_each_head_of_the_whole_layer_is_refused_by_a_sharded_module_saying_why(record, name):
    """The unsharded module takes a (B, n_heads, T, T) or (n_heads, T, T) mask; sharded, it said the mask "does not
    broadcast to (B, n_heads, ...)" with the rank's head count, on a model the user built with all of them. A mask
    of the rank's own head count was taken, each rank masking other heads than one process would."""
    tp, n_heads = record["world_size"], ATTENTION[name].n_heads
    for said in record["modules"][name]["per_head_mask"]:
        assert "has a mask per head, but this module is sharded by apply_tp" in said, said
        assert f"computes {n_heads // tp} of the layer's {n_heads} heads on each rank" in said
        assert "(B, 1, T_q, T_k)" in said


def test_sharded_mlp_equals_unsharded_and_splits_unevenly_where_it_must(record):
    got, tp = record["modules"]["mlp"], record["world_size"]
    assert got["forward"] < 1e-5 and got["input_grad"] < 1e-5 and got["weight_grad"] < 1e-5, got
    d, f = MLP_DIMS
    chunks = [len(c) for c in torch.arange(f).chunk(tp)]  # DTensor's Shard: torch.chunk's split
    assert got["local_params"] == [mlp_param_count(d, c, "swiglu", False) for c in chunks]
    assert max(got["local_params"]) == mlp_param_count(d, -(-f // tp), "swiglu", False)  # the cost model's
    # a plain (GELU) MLP has no w3: the plan named it, and torch warned on every rank that it could not resolve it
    plain = record["modules"]["mlp_gelu"]
    assert plain["forward"] < 1e-5 and plain["input_grad"] < 1e-5 and plain["weight_grad"] < 1e-5, plain
    assert got["warnings"] == plain["warnings"] == []


@pytest.mark.parametrize("name", list(MODELS))
def test_sharded_transformer_generates_the_one_process_greedy_tokens(record, name):
    got, tp, cfg = record["models"][name], record["world_size"], MODELS[name]
    if (
        "refused" in got
    ):  # a family example check_shardable refuses at this size (q/k norms, heads tp does not divide)
        with pytest.raises(ValueError) as err:
            check_shardable(cfg, tp)
        assert str(err.value) == got["refused"]
        assert tp > 2 or cfg.layer_attentions[0].qk_norm != "none", got  # every other family shards at tp 2
        pytest.skip(got["refused"])
    assert got["loss"] < 1e-5 and got["weight_grad"] < 1e-5, got
    # every rank's gradients are its own shares, no more: as many numbers as its weights
    assert got["pending_grads"] == [] and got["grad_numel"] == got["local_params"], got
    assert got["copy_embeds_itself"]
    assert got["tokens_sharded"] == [got["tokens_one_process"]] * tp
    assert got["tokens_sharded_no_cache"] == [got["tokens_one_process"]] * tp
    assert max(got["local_params"]) == model_param_count(
        rank_config(cfg, tp)
    )  # rank 0: the larger vocab share
    assert got["cache_bytes"] == [kv_cache_bytes(rank_config(cfg, tp), 2, 16, "fp64")] * tp  # float64 models


def test_bad_tp_and_head_combinations_raise_before_any_collective(record):
    bad = record["bad"]
    for name in ("gqa_kv_heads", "mla_heads", "model_heads", "ranks"):
        assert bad[name]["raised"] == "ValueError", (name, bad[name])
        assert bad[name]["seconds"] < 5, (name, bad[name])  # rank 0 alone: a collective would have hung
    tp = record["world_size"]
    assert f"tp={tp} must divide n_kv_heads=3" in bad["gqa_kv_heads"]["message"]
    assert f"tp={tp} must divide n_heads=" in bad["mla_heads"]["message"]
    assert "--tp 3 must divide the number of ranks" in bad["ranks"]["message"]


def test_a_mesh_apply_tp_cannot_use_is_a_value_error_that_says_what_to_pass(record):
    bad, world = record["bad"], record["world_size"]
    for name in ("mesh_2d", "mesh_2d_unnamed", "mesh_without_rank"):
        assert bad[name]["raised"] == "ValueError", (name, bad[name])
        assert bad[name]["seconds"] < 5, (name, bad[name])  # rank 0 alone: a collective would have hung
    shape = f"2-D mesh of shape ({world // 2}, 2)"
    assert bad["mesh_2d"]["message"] == (
        f"apply_tp splits heads over a 1-D mesh; got a {shape} named ('dp', 'tp'): pass the dimension to split "
        "heads over, mesh['dp'] or mesh['tp']"
    )
    assert bad["mesh_2d_unnamed"]["message"] == (
        f"apply_tp splits heads over a 1-D mesh; got a {shape}: name its dimensions "
        "(init_device_mesh(..., mesh_dim_names=('dp', 'tp'))) and pass mesh['tp']"
    )
    assert bad["mesh_without_rank"]["message"] == (
        f"apply_tp: rank 0 is not in the mesh (ranks [{world - 1}]); pass the mesh, or the slice of a larger mesh, "
        "that holds this rank"
    )


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory, kv1_llama, corpus) -> list[float]:
    """The reference run: the same two steps on one process with the whole batch of 4."""
    dst = tmp_path_factory.mktemp("one") / "dst"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        opts = UptrainOptions(src=kv1_llama, dst=dst, data=corpus, steps=2, batch_size=4, seq_len=32, lr=3e-3,
                              warmup=1, save_every=0)  # fmt: skip
        assert uptrain(opts, progress=False)["global_batch"] == 4
    finally:
        torch.set_num_threads(before)
    return [json.loads(x) for x in (dst / "uptrain_log.jsonl").read_text().splitlines()]


def test_two_uptraining_steps_with_tp_give_the_one_process_losses(record, one_process_losses):
    got, world = record["uptrain"], record["world_size"]
    assert got["summary"] == {"tp": 2, "world_size": world, "fsdp": world > 2, "global_batch": 4}
    assert got["losses"] == pytest.approx([r["loss"] for r in one_process_losses], rel=1e-5)
    assert got["grad_norms"] == pytest.approx([r["grad_norm"] for r in one_process_losses], rel=1e-4)
    # with FSDP2 over the heads' ranks, torch warned on every rank that the logits (a view) might get wrong
    # gradients if changed in place, which the loop never does
    assert not [w for w in got["warnings"] if "returned a view tensor" in w], got["warnings"]
    assert not got[
        "filters_leaked"
    ]  # the filter is the run's: a user's own FSDP2 code still gets the warning


def test_tp_without_enough_ranks_is_a_clear_error_on_one_process(tmp_path, kv1_llama, corpus):
    opts = UptrainOptions(src=kv1_llama, dst=tmp_path / "d", data=corpus, steps=1, tp=2)
    with pytest.raises(ValueError, match=r"--tp 2 must divide the number of ranks \(1\)"):
        uptrain(opts, progress=False)
    assert not (tmp_path / "d").exists()


def test_uptrain_cli_tp_on_one_process_is_one_line_and_exit_2(tmp_path, kv1_llama, corpus):
    result = run_cli("uptrain", kv1_llama, tmp_path / "d", "--data", corpus, "--steps", 1, "--tp", 2)
    assert result.exit_code == 2 and "--tp 2 must divide the number of ranks (1)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "d").exists()


def test_check_tp_names_the_rule_that_fails():
    check_tp(ATTENTION["gqa2"], 8)  # 8 ranks, 2 KV heads: each replicated on 4
    with pytest.raises(ValueError, match=r"tp=3 must divide n_heads=8"):
        check_tp(ATTENTION["mqa"], 3)
    with pytest.raises(ValueError, match=r"tp=4 must divide n_kv_heads=6 .* or be a multiple of it"):
        check_tp(ATTENTION["mha"].replace(n_heads=12, n_kv_heads=6, head_dim=8), 4)
    with pytest.raises(TypeError):
        check_tp(ATTENTION["mha"], 2.0)


def test_q_k_norms_are_refused_before_any_collective(tmp_path, tokenizer, corpus, monkeypatch):
    """apply_tp does not shard q/k norms: a per-head gain would get each rank's share of its gradient only, a norm
    over all heads would see each rank's heads only. Refused (apply_tp, uptrain --tp) instead of training wrong."""
    for qk_norm in ("head", "full"):
        cfg = ATTENTION["gqa2"].replace(qk_norm=qk_norm)
        check_shardable(cfg, 1)
        with pytest.raises(
            ValueError,
            match=rf"tp=2: tensor parallelism does not shard q/k norms yet \(qk_norm='{qk_norm}'\)",
        ):
            check_shardable(one_layer(cfg), 2)
    src = make_llama(tmp_path / "qwen3", tokenizer, kind="qwen3", head_dim=8)
    two_ranks = distributed.Env(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    monkeypatch.setattr(
        distributed, "setup", lambda tp=1, device="auto": two_ranks
    )  # rank 0 of 2: a collective would hang
    opts = UptrainOptions(src=src, dst=tmp_path / "d", data=corpus, steps=1, tp=2)
    with pytest.raises(ValueError, match=r"--tp 2: tensor parallelism does not shard q/k norms yet"):
        uptrain(opts, progress=False)
    assert not (tmp_path / "d").exists()


def test_a_split_smaller_than_tp_is_refused():
    """3 rows over 4 ranks (an untied vocabulary, the MLP's width): DTensor gave the gradient another placement than
    its weight, and every optimizer step failed (aten.add_: in-place operations that require placement changes).
    A tied table stays whole, so it shards; an empty share (5 rows over 4 ranks: 2, 2, 1, 0) trains."""
    from attnlab import parallel
    from attnlab.model import FeedForward

    small = MODELS["mqa"].replace(vocab_size=3)
    with pytest.raises(
        ValueError, match=r"tp=4: vocab_size=3 is split over the ranks and must be at least tp"
    ):
        check_shardable(small, 4)
    check_shardable(small, 2)
    check_shardable(small.replace(tie_embeddings=True), 4)
    check_shardable(small.replace(vocab_size=5), 4)
    with pytest.raises(
        ValueError, match=r"--tp 4: ffn_dim=3 is split over the ranks and must be at least tp"
    ):
        check_shardable(MODELS["mqa"].replace(ffn_dim=3), 4, flag="--tp")
    with pytest.raises(ValueError, match=r"tp=4: hidden=2 is split"):
        parallel._check_module(FeedForward(8, 2), 4)  # apply_tp's checks, before any collective
