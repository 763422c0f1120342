"""Tensor parallelism by heads: ``apply_tp(module, mesh)`` shards our attention modules, the decoder MLP and the
``Transformer`` over the ranks of a 1-D device mesh, with DTensor plans keyed by submodule name (as torchtitan's
``apply_tp``), from outside the model: the model code reads its head counts from its own (local) weights.

The layout is Megatron-LM's (Shoeybi et al. 2019, arXiv 1909.08053, Sec. 3). Rank r of tp computes query heads
[r * n_heads / tp, (r + 1) * n_heads / tp) from end to end: the Q/K/V projections are column-parallel (their
weight rows are split by head), attention needs no communication, and the output projection is row-parallel, so
its partial sums are all-reduced. The MLP is split the same way (w1, w3 by columns of the hidden layer, w2 by
rows). One all-reduce per attention and one per MLP in the forward; one more each in the backward.

Which KV heads a rank holds (query head i reads KV head i // (n_heads / n_kv_heads), DESIGN.md):

- tp <= n_kv_heads: rank r holds KV heads [r * n_kv_heads / tp, (r + 1) * n_kv_heads / tp); nothing is repeated.
- tp > n_kv_heads (MQA, or Llama-2-70B's 8 KV heads on 16 ranks): a rank's query heads all read KV head
  r // (tp / n_kv_heads), so every KV head is held, and cached, by tp / n_kv_heads ranks (vLLM does the same).
  wk and wv live on a (kv, rep) view of the mesh: split over "kv", replicated over "rep".
- MLA: the query heads (``wq`` or ``wq_b``) and ``wkv_b`` are split by head; ``wq_a``, ``q_norm``, ``wkv_a`` and
  ``kv_norm`` are replicated, so every rank computes and caches the whole latent.

Gradients. A tensor every rank computes whole but that feeds only this rank's heads (the block input, MLA's
latent, a replicated KV head) gets a partial gradient on each rank; the true one is the sum over the ranks. Each
such hand-over is marked with DTensor's ``Partial`` gradient placement, so the sums happen where DTensor needs
them: once for the attention / MLP input (the backward all-reduce), and for a replicated weight when its
gradient is accumulated (``_sum_partial_grad``).

Checks come first: a tp that does not divide n_heads, or that neither divides nor is divided by n_kv_heads, is a
ValueError raised before any collective is issued, so a bad launch fails on every rank instead of hanging.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from .attention.gqa import GroupedQueryAttention
from .attention.mla import MultiHeadLatentAttention
from .config import AttentionConfig, MLAConfig, ModelConfig
from .cost.parallel import check_tp, kv_heads_per_rank, kv_replicas
from .model import FeedForward, Transformer

__all__ = [
    "apply_tp",
    "attention_plan",
    "check_shardable",
    "check_tp",
    "kv_heads_per_rank",
    "kv_replicas",
    "mlp_plan",
]


def check_shardable(cfg: AttentionConfig | MLAConfig | ModelConfig, tp: int, *, flag: str = "tp") -> None:
    """``check_tp``, and what ``apply_tp`` does not shard: q/k norms (Qwen3, OLMo 2, Gemma 3), refused when tp > 1.
    A per-head norm's gain would be trained on each rank's share of the heads' gradient alone (never summed), and a
    norm over all heads would normalise each rank's heads by their own RMS (and its gain does not match them)."""
    check_tp(cfg, tp, flag=flag)
    attentions = cfg.layer_attentions if isinstance(cfg, ModelConfig) else (cfg,)
    norms = sorted({a.qk_norm for a in attentions if isinstance(a, AttentionConfig)} - {"none"})
    if tp > 1 and norms:
        given = f"{flag} {tp}" if flag.startswith("--") else f"{flag}={tp}"
        raise ValueError(
            f"{given}: tensor parallelism does not shard q/k norms yet (qk_norm={norms[0]!r}); use tp 1 "
            "(data parallelism alone)"
        )


# ---- gradients that are partial sums over the ranks -------------------------------------------------------------


def _sum_partial_grad(param: nn.Parameter) -> None:
    """A replicated weight's accumulated gradient, still a partial sum over ranks, becomes the sum (all-reduce)."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _distribute_params(module: nn.Module, mesh: DeviceMesh, placements: list) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist_param = nn.Parameter(distribute_tensor(param.data, mesh, placements), param.requires_grad)
        if any(p.is_replicate() for p in placements):
            dist_param.register_post_accumulate_grad_hook(_sum_partial_grad)
        module.register_parameter(name, dist_param)


def _replicated_input(x, mesh: DeviceMesh) -> DTensor:
    """``x``, which every rank holds whole, as a DTensor replicated on ``mesh`` whose gradient is handed back as this
    rank's partial sum (summed later, where the whole gradient is needed)."""
    if isinstance(x, DTensor):
        if x.device_mesh == mesh:
            return x
        x = x.to_local(grad_placements=[Partial()] * x.device_mesh.ndim)
    n = mesh.ndim
    return DTensor.from_local(x, mesh, [Replicate()] * n, run_check=False, grad_placements=[Partial()] * n)


class Replicated(ParallelStyle):
    """The whole module on every rank, computed redundantly on a replicated input; its output feeds this rank's
    heads only, so the gradient that comes back is a partial sum (MLA's ``wq_a``, ``q_norm``, ``wkv_a``,
    ``kv_norm``). Its weights are replicated DTensors whose gradients are summed when accumulated."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            mesh,
            lambda _name, mod, m: _distribute_params(mod, m, [Replicate()]),
            lambda _mod, inputs, m: (_replicated_input(inputs[0], m), *inputs[1:]),
            lambda _mod, out, m: out.to_local(grad_placements=[Partial()]),
        )


class ColwiseFromReplicated(ColwiseParallel):
    """Column-parallel (split by head) behind a ``Replicated`` module: the input's gradient stays this rank's
    partial sum, as the module before it expects (MLA's ``wq_b`` and ``wkv_b``)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            mesh,
            self._partition_linear_fn,
            lambda _mod, inputs, m: (_replicated_input(inputs[0], m), *inputs[1:]),
            lambda _mod, out, m: out.to_local(),
        )


class ReplicatedKVHeads(ParallelStyle):
    """wk / wv when tp > n_kv_heads: the weight rows of KV head j live on ranks [j * rep, (j + 1) * rep),
    rep = tp / n_kv_heads, on a (kv, rep) view of the mesh (split over kv, replicated over rep). A replica's output
    feeds only its own query heads, so gradients come back as partial sums over "rep"."""

    def __init__(self, n_kv_heads: int) -> None:
        super().__init__()
        self.n_kv_heads = n_kv_heads

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        tp = mesh.size()
        # DeviceMesh._unflatten views one axis as two (private in torch 2.13, which attnlab pins); it creates the
        # new axes' process groups, so every rank makes the same call, after the checks of apply_tp.
        kv_mesh = mesh._unflatten(0, (self.n_kv_heads, tp // self.n_kv_heads), ("kv", "rep"))
        return distribute_module(
            module,
            kv_mesh,
            lambda _name, mod, m: _distribute_params(mod, m, [Shard(0), Replicate()]),
            lambda _mod, inputs, m: (_replicated_input(inputs[0], m), *inputs[1:]),
            lambda _mod, out, m: _ContiguousGrad.apply(
                out.to_local(grad_placements=[Shard(out.ndim - 1), Partial()])
            ),
        )


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient. A strided one (the key gradient of the explicit
    grouped attention, e.g. with soft-capping) made DTensor's linear backward shard the input gradient over the
    batch on the "rep" axis, which it then cannot turn into the partial sum the input expects."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _replicated_block_input() -> PrepareModuleInput:
    """The attention / MLP input as a replicated DTensor: the gradients its projections send back are summed into
    one all-reduce."""
    return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))


# ---- plans, keyed by submodule name ----------------------------------------------------------------------------


def attention_plan(attn: nn.Module, tp: int, prefix: str = "") -> dict[str, ParallelStyle]:
    """The plan of one attention module (names relative to its parent, after ``prefix``)."""
    p = prefix
    plan: dict[str, ParallelStyle] = {p.rstrip("."): _replicated_block_input()} if p else {}
    if isinstance(attn, GroupedQueryAttention):
        n_kv = attn.cfg.n_kv_heads
        kv = ColwiseParallel() if tp <= n_kv else ReplicatedKVHeads(n_kv)
        return plan | {f"{p}wq": ColwiseParallel(), f"{p}wk": kv, f"{p}wv": kv, f"{p}wo": RowwiseParallel()}
    if isinstance(attn, MultiHeadLatentAttention):
        if attn.cfg.q_lora_rank:
            plan |= {
                f"{p}wq_a": Replicated(),
                f"{p}q_norm": Replicated(),
                f"{p}wq_b": ColwiseFromReplicated(),
            }
        else:
            plan[f"{p}wq"] = ColwiseParallel()
        plan |= {f"{p}wkv_a": Replicated(), f"{p}wkv_b": ColwiseFromReplicated(), f"{p}wo": RowwiseParallel()}
        if attn.cfg.kv_norm:
            plan[f"{p}kv_norm"] = Replicated()
        return plan
    raise TypeError(f"no tensor-parallel plan for {type(attn).__name__}")


def mlp_plan(prefix: str = "") -> dict[str, ParallelStyle]:
    """w1, w3 split over the hidden units, w2 over its inputs. The hidden activations stay DTensors between them,
    so a hidden size tp does not divide (split as torch.chunk does) keeps its true global shape."""
    p = prefix
    plan: dict[str, ParallelStyle] = {p.rstrip("."): _replicated_block_input()} if p else {}
    hidden = {"use_local_output": False}
    return plan | {
        f"{p}w1": ColwiseParallel(**hidden),
        f"{p}w3": ColwiseParallel(**hidden),
        f"{p}w2": RowwiseParallel(),
    }


def _check_mesh(mesh: DeviceMesh) -> int:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"apply_tp needs the 1-D tensor-parallel mesh, got {mesh.ndim}-D {mesh.mesh_dim_names}; pass mesh['tp']"
        )
    return mesh.size()


def _check_module(module: nn.Module, tp: int) -> None:
    """Everything apply_tp checks, before anything is sharded (no collective has been issued yet)."""
    if isinstance(module, (Transformer, GroupedQueryAttention, MultiHeadLatentAttention)):
        check_shardable(module.cfg, tp)
    elif not isinstance(module, FeedForward):
        raise TypeError(
            "apply_tp shards GroupedQueryAttention, MultiHeadLatentAttention, FeedForward and Transformer; "
            f"got {type(module).__name__}"
        )
    if any(isinstance(p, DTensor) for p in module.parameters()):
        raise ValueError("apply_tp: the module is already sharded (its parameters are DTensors)")


def apply_tp(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard ``module`` by heads over the 1-D ``mesh`` in place and return it (see the module docstring).

    A sharded attention module takes and returns whole (B, T, d_model) tensors like the unsharded one; its
    ``n_heads`` / ``n_kv_heads`` and ``new_cache`` are this rank's. A ``Transformer`` also splits its embedding and
    output over the vocabulary (unless they are tied: then both stay whole) and returns whole logits.
    """
    tp = _check_mesh(mesh)
    _check_module(module, tp)
    if isinstance(module, FeedForward):
        return parallelize_module(module, mesh, {"": _replicated_block_input()} | mlp_plan())
    if not isinstance(module, Transformer):
        return parallelize_module(module, mesh, {"": _replicated_block_input()} | attention_plan(module, tp))
    for layer in module.layers:
        plan = attention_plan(layer.attention, tp, "attention.") | mlp_plan("feed_forward.")
        parallelize_module(layer, mesh, plan)
    if not module.cfg.tie_embeddings:  # a tied table is one tensor: it cannot be split two ways
        parallelize_module(
            module,
            mesh,
            {
                "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Replicate()),
            },
        )
    return module
