"""Every tensor-parallel check in one torchrun launch (ranks start once, not once per check), run by
test_tensor_parallel.py: ``torchrun --nproc-per-node N tp_worker.py OUT.json SRC DATA WORK``.

Each check builds the unsharded module on every rank from one seed, shards a copy with ``apply_tp`` over all N
ranks, and records how far the sharded one is from it (the maximum over ranks) together with the per-rank sizes
the cost model must predict. Rank 0 writes the record; the test asserts on it.
"""

from __future__ import annotations

import copy
import json
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from attnlab import AttentionConfig, GroupedQueryAttention, MLAConfig, MultiHeadLatentAttention
from attnlab.bench.families import example_config, loads
from attnlab.config import ModelConfig
from attnlab.families import REGISTERED
from attnlab.generate import generate
from attnlab.model import FeedForward, Transformer
from attnlab.parallel import apply_tp, check_shardable
from attnlab.train import UptrainOptions, distributed, uptrain

# Configs keyed by the names the test parametrises over; n_heads 8 splits over 2 and 4 ranks.
ATTENTION = {
    "mha": AttentionConfig(d_model=64, n_heads=8),
    "gqa4": AttentionConfig(d_model=64, n_heads=8, n_kv_heads=4, bias=True, out_bias=False),  # Qwen2's biases
    "gqa2": AttentionConfig(d_model=64, n_heads=8, n_kv_heads=2),
    "mqa": AttentionConfig(d_model=64, n_heads=8, n_kv_heads=1),
    "mla": MLAConfig(d_model=64, n_heads=8, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                     v_head_dim=8, q_lora_rank=24, bias=True),
    "mla-naive": MLAConfig(d_model=64, n_heads=8, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                           v_head_dim=8, mode="naive"),
}  # fmt: skip
MESH_MODULES = ("mqa", "gqa2", "mla")  # checked again on the meshes of mesh_checks
MLP_DIMS = (64, 90)  # 90 hidden units: an uneven split over 4 ranks (23, 23, 23, 21)
# vocab 97: an uneven split of the embedding and LM head; 9: on 4 ranks torch.chunk's 3, 3, 3 and 0 rows (the last
# rank's lookup failed on its empty table, and the others waited for it)
MODELS = {
    "mqa": ModelConfig(vocab_size=9, n_layers=2, attention=AttentionConfig(d_model=32, n_heads=4, n_kv_heads=1),
                       ffn_dim=64, max_seq_len=64),
    "mla": ModelConfig(vocab_size=97, n_layers=2, attention=MLAConfig(d_model=32, n_heads=4, kv_lora_rank=8,
                       qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8), ffn_dim=64, max_seq_len=64),
}  # fmt: skip
# Every family whose weights load, at its example config (the uptrain --tp cell of docs/families.md): the worker
# shards those that check_shardable takes at its world size and lists the others as refused.
MODELS |= {f"family-{fam.name}": example_config(fam) for fam in REGISTERED if loads(fam)}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def worst(x: float) -> float:
    """The maximum of ``x`` over the ranks."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def gathered(x) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def local_numel(module: torch.nn.Module) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())


def weight_grad_error(ref: torch.nn.Module, sharded: torch.nn.Module) -> float:
    """The worst weight-gradient difference over weights and ranks, relative to that weight's largest gradient."""
    params = dict(sharded.named_parameters())
    errors = [
        ((p.grad - full(params[n].grad)).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item()
        for n, p in ref.named_parameters()
    ]
    return worst(max(errors))


def compare_module(ref: torch.nn.Module, mesh, d_model: int, cache: bool) -> dict:
    """Forward, input and weight gradients, and (for attention) prefill + decode through a cache; and what
    apply_tp warned."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        sharded = apply_tp(copy.deepcopy(ref), mesh)
    x = torch.randn(2, 7, d_model, generator=torch.Generator().manual_seed(1))
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_tp = ref(x_ref), sharded(x_tp)
    g = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(2))
    y_ref.backward(g)
    y_tp.backward(g)
    params = dict(sharded.named_parameters())
    out = {
        "forward": worst((y_ref - y_tp).abs().max().item()),
        "input_grad": worst((x_ref.grad - x_tp.grad).abs().max().item()),
        "weight_grad": weight_grad_error(ref, sharded),
        "local_params": gathered(local_numel(sharded)),
        # A gradient still "Partial" (a pending sum over ranks) would read right through full_tensor() above but
        # leave each rank's local gradient wrong: every accumulated gradient must have its weight's placement.
        "warnings": [str(w.message).splitlines()[0] for w in said],
        "pending_grads": sorted(
            n for n, p in params.items() if isinstance(p, DTensor) and p.grad.placements != p.placements
        ),
    }
    if cache:
        with torch.no_grad():
            c_ref, c_tp = ref.new_cache(2, 7), sharded.new_cache(2, 7)
            parts = [(0, 4), (4, 5), (5, 6), (6, 7)]  # a prefill, then one token at a time
            a = torch.cat([ref(x[:, i:j], cache=c_ref) for i, j in parts], 1)
            b = torch.cat([sharded(x[:, i:j], cache=c_tp) for i, j in parts], 1)
        out["per_head_mask"] = []
        # a mask per head of the whole layer (4-D and 3-D), and one of the rank's own head count
        for shape in ((2, ref.cfg.n_heads, 7, 7), (ref.cfg.n_heads, 7, 7), (2, sharded.n_heads, 7, 7)):
            try:
                sharded(x, attn_mask=torch.ones(shape, dtype=torch.bool).tril())
                out["per_head_mask"].append("taken")
            except ValueError as err:
                out["per_head_mask"].append(str(err))
        out |= {
            "decode": worst((a - b).abs().max().item()),
            "decode_vs_forward": worst((b - y_ref.detach()).abs().max().item()),
            "cache_bytes": gathered(c_tp.nbytes),
            "heads": gathered([sharded.n_heads, getattr(sharded, "n_kv_heads", None)]),
        }
    return out


def attention_module(cfg: AttentionConfig | MLAConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    module = (GroupedQueryAttention if isinstance(cfg, AttentionConfig) else MultiHeadLatentAttention)(cfg)
    module.init_weights(0.2)  # larger than the default 0.02: attention far from uniform
    return module


def module_checks(mesh) -> dict:
    out = {}
    for name, cfg in ATTENTION.items():
        out[name] = compare_module(attention_module(cfg), mesh, cfg.d_model, cache=True)
    torch.manual_seed(0)
    out["mlp"] = compare_module(FeedForward(*MLP_DIMS), mesh, MLP_DIMS[0], cache=False)
    torch.manual_seed(0)
    out["mlp_gelu"] = compare_module(FeedForward(*MLP_DIMS, kind="gelu"), mesh, MLP_DIMS[0], cache=False)
    return out


def mesh_checks() -> dict:
    """MQA, GQA and MLA on 1-D meshes made the other ways a user makes them: all ranks without dimension names,
    and the "tp" dimension of a 2-D ("dp", "tp") mesh (of shape (1, 2) on 2 ranks, (2, 2) on 4: two slices)."""
    world = dist.get_world_size()
    meshes = {
        "unnamed": init_device_mesh("cpu", (world,)),
        "tp-of-2d": init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))["tp"],
    }
    out = {}
    for mesh_name, mesh in meshes.items():
        out[mesh_name] = {"tp": mesh.size(), "ranks": gathered(mesh.mesh.tolist())}
        for name in MESH_MODULES:
            cfg = ATTENTION[name]
            out[mesh_name][name] = compare_module(attention_module(cfg), mesh, cfg.d_model, cache=True)
    return out


def model_checks(mesh) -> dict:
    """Whole models: logits and gradients, and greedy generation with the caches (with and without them)."""
    out = {}
    for name, cfg in MODELS.items():
        try:
            check_shardable(cfg, mesh.size())
        except ValueError as err:
            out[name] = {"refused": str(err)}
            continue
        ref = Transformer(cfg)
        ref.init_weights(std=0.3, seed=0)
        # float64: what is compared is the sharding's arithmetic, not float32's summation order, which differs
        # between the ranks' partial products and one process's (1.2e-5 relative on an AVX-512 EPYC in float32)
        ref.double()
        sharded = apply_tp(copy.deepcopy(ref), mesh)
        tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
        losses = []
        for model in (ref, sharded):
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            losses.append(loss.item())
        prompt = tokens[:, :5]
        out[name] = {
            "loss": worst(abs(losses[0] - losses[1])),
            "weight_grad": weight_grad_error(ref, sharded),
            "local_params": gathered(local_numel(sharded)),
            # each gradient has its weight's placement: the embedding's was the whole table on every rank
            # (DTensor's embedding rule), kept until the optimizer step
            "pending_grads": sorted(
                n
                for n, p in sharded.named_parameters()
                if isinstance(p, DTensor) and p.grad.placements != p.placements
            ),
            "grad_numel": gathered(
                sum(
                    (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).numel()
                    for p in sharded.parameters()
                )
            ),
            # a deep copy's embedding looks ids up in its own rows, not in the original's
            "copy_embeds_itself": cfg.tie_embeddings or embeds_itself(copy.deepcopy(sharded)),
            "cache_bytes": gathered(sum(c.nbytes for c in sharded.new_caches(2, 16))),
            "tokens_one_process": generate(ref, prompt, 11).tokens,
            "tokens_sharded": gathered(generate(sharded, prompt, 11).tokens),
            "tokens_sharded_no_cache": gathered(greedy_without_cache(sharded, prompt, 11)),
        }
    return out


def embeds_itself(model: Transformer) -> bool:
    """Whether a sharded model's embedding forward (VocabParallelEmbedding's) is bound to its own module."""
    return model.tok_embeddings.forward.__self__ is model.tok_embeddings


@torch.no_grad()
def greedy_without_cache(model: Transformer, prompt: torch.Tensor, n: int) -> list[list[int]]:
    """The new tokens of greedy decoding that reruns the whole sequence every step (no cache)."""
    tokens = prompt
    for _ in range(n):
        tokens = torch.cat((tokens, model(tokens)[:, -1:].argmax(-1)), dim=1)
    return tokens[:, prompt.shape[1] :].tolist()


def on_rank0_alone(fn) -> dict:
    """Run ``fn`` on rank 0 only, in a thread: it must raise at once. Had it issued a collective, it would wait
    for ranks that never join it; after 30 s the check reports it hung."""
    result: dict = {}

    def run() -> None:
        start = time.perf_counter()
        try:
            fn()
            result["raised"] = None
        except Exception as err:  # the point is to record what was raised
            result["raised"] = type(err).__name__
            result["message"] = str(err)
        result["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=30)
    return result if not thread.is_alive() else {"raised": "hung", "seconds": 30.0}


def bad_combo_checks(mesh) -> dict:
    out = {}
    if dist.get_rank() == 0:
        tp = mesh.size()
        bad_kv = AttentionConfig(d_model=48, n_heads=6 if tp == 2 else 12, n_kv_heads=3)  # 3 vs tp 2 or 4
        out["gqa_kv_heads"] = on_rank0_alone(lambda: apply_tp(GroupedQueryAttention(bad_kv), mesh))
        bad_heads = MLAConfig(d_model=48, n_heads=6 if tp == 4 else 3, kv_lora_rank=8, qk_nope_head_dim=8,
                              qk_rope_head_dim=4, v_head_dim=8)  # fmt: skip
        out["mla_heads"] = on_rank0_alone(lambda: apply_tp(MultiHeadLatentAttention(bad_heads), mesh))
        bad_heads_model = AttentionConfig(d_model=36, n_heads=3 * (tp // 2))  # 3 or 6 heads on 2 or 4 ranks
        bad_model = MODELS["mqa"].replace(attention=bad_heads_model)
        out["model_heads"] = on_rank0_alone(lambda: apply_tp(Transformer(bad_model), mesh))
        out["ranks"] = on_rank0_alone(lambda: distributed.setup(tp=3))
    # Meshes apply_tp cannot use; made by every rank (making them is collective), passed by rank 0 alone.
    world = dist.get_world_size()
    meshes = {
        "mesh_2d": init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp")),
        "mesh_2d_unnamed": init_device_mesh("cpu", (world // 2, 2)),
        "mesh_without_rank": DeviceMesh("cpu", [world - 1]),
    }
    if dist.get_rank() == 0:
        mqa = ATTENTION["mqa"]
        for name, bad_mesh in meshes.items():
            out[name] = on_rank0_alone(lambda m=bad_mesh: apply_tp(GroupedQueryAttention(mqa), m))
    dist.barrier()  # every rank gets here: nothing above left a collective half-issued
    return out


def uptrain_check(src: Path, data: Path, work: Path) -> dict:
    """Two steps of ``attnlab uptrain`` with the heads over 2 ranks (and, on 4, two data-parallel replicas)."""
    world = dist.get_world_size()
    opts = UptrainOptions(
        src=src, dst=work / "tp-dst", data=data, steps=2, batch_size=4 // (world // 2), seq_len=32, lr=3e-3,
        warmup=1, save_every=0, tp=2, overwrite=True,
    )  # fmt: skip
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        inside = list(warnings.filters)
        summary = uptrain(opts, progress=False)
        leaked = warnings.filters != inside  # what uptrain filtered stays filtered after it returned
    assert warnings.filters == before
    log = [json.loads(line) for line in (opts.dst / "uptrain_log.jsonl").read_text().splitlines()]
    return {"summary": {k: summary[k] for k in ("tp", "world_size", "fsdp", "global_batch")},
            "losses": [r["loss"] for r in log], "grad_norms": [r["grad_norm"] for r in log],
            "warnings": sorted({str(w.message).splitlines()[0][:120] for w in said}), "filters_leaked": leaked}  # fmt: skip


def main() -> None:
    out_path, src, data, work = (Path(a) for a in sys.argv[1:5])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    timings: dict[str, float] = {}
    report: dict = {"world_size": dist.get_world_size()}
    for name, check in (
        ("modules", lambda: module_checks(mesh)),
        ("meshes", mesh_checks),
        ("models", lambda: model_checks(mesh)),
        ("bad", lambda: bad_combo_checks(mesh)),
        ("uptrain", lambda: uptrain_check(src, data, work)),
    ):
        start = time.perf_counter()
        report[name] = check()
        timings[name] = round(time.perf_counter() - start, 2)
    report["seconds"] = timings
    if dist.get_rank() == 0:
        out_path.write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
