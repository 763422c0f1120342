"""Tensor parallelism by heads: ``apply_tp(module, mesh)`` shards our attention modules, the decoder MLP and the
``Transformer`` over the ranks of a 1-D device mesh (made with or without dimension names, or one dimension of a
larger mesh such as ``mesh["tp"]`` of a ("dp", "tp") mesh), with DTensor plans keyed by submodule name (as
torchtitan's ``apply_tp``), from outside the model: the model code reads its head counts from its own (local)
weights.

The layout is Megatron-LM's (Shoeybi et al. 2019, arXiv 1909.08053, Sec. 3). Rank r of tp computes query heads
[r * n_heads / tp, (r + 1) * n_heads / tp) from end to end: the Q/K/V projections are column-parallel (their
weight rows are split by head), attention needs no communication, and the output projection is row-parallel, so
its partial sums are all-reduced. The MLP is split the same way (w1, w3 by columns of the hidden layer, w2 by
rows). One all-reduce per attention and one per MLP in the forward; one more each in the backward.

Which KV heads a rank holds (query head i reads KV head i // (n_heads / n_kv_heads), DESIGN.md):

- tp <= n_kv_heads: rank r holds KV heads [r * n_kv_heads / tp, (r + 1) * n_kv_heads / tp); nothing is repeated.
- tp > n_kv_heads (MQA, or Llama-2-70B's 8 KV heads on 16 ranks): a rank's query heads all read KV head
  r // (tp / n_kv_heads), so every KV head is held, and cached, by tp / n_kv_heads ranks (vLLM does the same).
  With one KV head, wk and wv are replicated over the mesh; with more, they live on a (kv, rep) view of it, split
  over "kv" and replicated over "rep", whose process groups ``_kv_rep_mesh`` makes with public torch calls.
- MLA: the query heads (``wq`` or ``wq_b``) and ``wkv_b`` are split by head; ``wq_a``, ``q_norm``, ``wkv_a`` and
  ``kv_norm`` are replicated, so every rank computes and caches the whole latent.

Gradients. A tensor every rank computes whole but that feeds only this rank's heads (the block input, MLA's
latent, a replicated KV head) gets a partial gradient on each rank; the true one is the sum over the ranks. Each
such hand-over is marked with DTensor's ``Partial`` gradient placement, so the sums happen where DTensor needs
them: once for the attention / MLP input (the backward all-reduce), and for a replicated weight when its
gradient is accumulated (``_sum_partial_grad``).

Checks come first: a mesh of more than one dimension, a mesh without this rank, or a tp that does not divide n_heads
or that neither divides nor is divided by n_kv_heads, is a ValueError raised before any collective is issued, so a
bad launch fails on every rank instead of hanging.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
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
from .config import GATED_MLPS, AttentionConfig, MLAConfig, ModelConfig
from .cost.parallel import check_tp, kv_heads_per_rank, kv_replicas
from .model import FeedForward, Transformer

__all__ = [
    "VocabParallelEmbedding",
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
    given = f"{flag} {tp}" if flag.startswith("--") else f"{flag}={tp}"
    if isinstance(cfg, ModelConfig):
        split = {"ffn_dim": cfg.ffn_dim} | ({} if cfg.tie_embeddings else {"vocab_size": cfg.vocab_size})
        check_split_sizes(split, tp, given)
    attentions = cfg.layer_attentions if isinstance(cfg, ModelConfig) else (cfg,)
    norms = sorted({a.qk_norm for a in attentions if isinstance(a, AttentionConfig)} - {"none"})
    if tp > 1 and norms:
        raise ValueError(
            f"{given}: tensor parallelism does not shard q/k norms yet (qk_norm={norms[0]!r}); use tp 1 "
            "(data parallelism alone)"
        )


def check_split_sizes(sizes: dict[str, int], tp: int, given: str) -> None:
    """The sizes split over the ranks by rows (the MLP's width, an untied vocabulary) must be at least tp: with
    fewer rows than ranks DTensor gave the gradient another placement than its weight, and every optimizer step
    failed ("in-place operations that require placement changes are not supported"). A rank whose share is empty
    works (a vocabulary of 5 over 4 ranks: 2, 2, 1, 0)."""
    for name, size in sizes.items():
        if size < tp:
            raise ValueError(
                f"{given}: {name}={size} is split over the ranks and must be at least tp; use tp <= {size}"
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


class ColwiseFromReplicated(ParallelStyle):
    """Column-parallel (split by head) behind a ``Replicated`` module: the input's gradient stays this rank's
    partial sum, as the module before it expects (MLA's ``wq_b`` and ``wkv_b``)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            mesh,
            lambda _name, mod, m: _distribute_params(mod, m, [Shard(0)]),
            lambda _mod, inputs, m: (_replicated_input(inputs[0], m), *inputs[1:]),
            lambda _mod, out, m: out.to_local(),
        )


def _vocab_parallel_lookup(self: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    """``VocabParallelEmbedding``'s forward, bound to the module (a deep copy of the model binds it to the copy)."""
    rows, mesh = self.weight.to_local(), self.weight.device_mesh
    local = tokens - self.vocab_start
    outside = (local < 0) | (local >= rows.shape[0])
    if rows.shape[0]:
        part = F.embedding(local.masked_fill(outside, 0), rows).masked_fill(outside.unsqueeze(-1), 0.0)
    else:  # torch.chunk left this rank no rows (a vocabulary of 9 over 4 ranks: 3, 3, 3, 0): zeros, tied to them
        part = rows.sum(0).expand(*tokens.shape, rows.shape[1])
    # summed over the ranks; the gradient comes back whole (replicated) to every rank's rows
    summed = DTensor.from_local(part, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()])
    return summed.to_local()


class VocabParallelEmbedding(ParallelStyle):
    """The token embedding split over the vocabulary (its rows, as torch.chunk splits them: ``Shard(0)``): each rank
    looks the ids up in its own rows, zeros for the others, and the partial embeddings are summed (all-reduce), as
    Megatron-LM's VocabParallelEmbedding. DTensor's rule for an embedding (``RowwiseParallel``) computes the same
    forward, but its backward builds the whole (vocab, d_model) gradient on every rank and keeps it, replicated,
    until the optimizer step; looked up in the local rows, each rank's gradient is its own rows."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding shards an nn.Embedding, got {type(module).__name__}")
        _distribute_params(module, mesh, [Shard(0)])
        vocab = module.num_embeddings
        # this rank's first row in torch.chunk's split: chunks of ceil(vocab / tp) rows
        module.vocab_start = min(mesh.get_local_rank() * -(-vocab // mesh.size()), vocab)
        # the instance's forward: nn.Embedding's would take DTensor's rule
        module.forward = types.MethodType(_vocab_parallel_lookup, module)
        return module


class ReplicatedKVHeads(ParallelStyle):
    """wk / wv when tp > n_kv_heads: the weight rows of KV head k live on mesh ranks [k * rep, (k + 1) * rep),
    rep = tp / n_kv_heads. One KV head is replicated over the whole mesh; more live on the (kv, rep) view of the
    mesh (split over kv, replicated over rep). A replica's output feeds only its own query heads, so gradients come
    back as partial sums over the replicas.

    ``views`` holds the (kv, rep) meshes made so far, by n_kv_heads: ``apply_tp`` shares one between the layers of
    a call, so a model makes each view's process groups once, not once per layer."""

    def __init__(self, n_kv_heads: int, views: dict[int, DeviceMesh] | None = None) -> None:
        super().__init__()
        self.n_kv_heads = n_kv_heads
        self.views = {} if views is None else views

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if self.n_kv_heads == 1:  # every rank holds the one KV head: no view, no new process group
            kv_mesh, weights = mesh, [Replicate()]
        else:
            if self.n_kv_heads not in self.views:
                self.views[self.n_kv_heads] = _kv_rep_mesh(mesh, self.n_kv_heads)
            kv_mesh, weights = self.views[self.n_kv_heads], [Shard(0), Replicate()]

        def local_output(_mod: nn.Module, out: DTensor, _mesh: DeviceMesh) -> torch.Tensor:
            # split over kv by head (the output's last dimension), a partial sum over the replicas
            grads = [Shard(out.ndim - 1), Partial()][-out.device_mesh.ndim :]
            return _ContiguousGrad.apply(out.to_local(grad_placements=grads))

        return distribute_module(
            module,
            kv_mesh,
            lambda _name, mod, m: _distribute_params(mod, m, weights),
            lambda _mod, inputs, m: (_replicated_input(inputs[0], m), *inputs[1:]),
            local_output,
        )


def _kv_rep_mesh(mesh: DeviceMesh, n_kv_heads: int) -> DeviceMesh:
    """The 1-D ``mesh`` viewed as (kv, rep) = (n_kv_heads, tp / n_kv_heads): mesh rank k * rep + j holds KV head k.

    Made with public calls only, so that any 1-D mesh will do (named or not, whole or one dimension of a larger
    mesh). Each rank makes the two process groups it belongs to, its "kv" group (same j), then its "rep" group
    (same k), with ``new_group(use_local_synchronization=True)``: only a group's members take part, since the ranks
    of one slice of a larger mesh cannot know the other slices. As every rank makes its "kv" group first, no two
    ranks wait on each other in opposite orders; as the groups' names count the groups a rank already has, every
    rank of the mesh must make the same ``apply_tp`` calls (as it must anyway). ``DeviceMesh.from_group`` wraps the
    groups. (``DeviceMesh._unflatten``, used before, is private and needed named dimensions.)"""
    ranks = mesh.mesh.view(n_kv_heads, -1)  # global ranks; row k holds KV head k
    k, j = divmod(mesh.get_local_rank(), ranks.shape[1])
    groups = [
        dist.new_group(members.tolist(), use_local_synchronization=True)
        for members in (ranks[:, j], ranks[k])
    ]
    return DeviceMesh.from_group(groups, mesh.device_type, mesh=ranks, mesh_dim_names=("kv", "rep"))


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


def attention_plan(
    attn: nn.Module, tp: int, prefix: str = "", kv_views: dict[int, DeviceMesh] | None = None
) -> dict[str, ParallelStyle]:
    """The plan of one attention module (names relative to its parent, after ``prefix``). ``kv_views``: the
    (kv, rep) meshes of replicated KV heads to share with other layers (see ``ReplicatedKVHeads``)."""
    p = prefix
    plan: dict[str, ParallelStyle] = {p.rstrip("."): _replicated_block_input()} if p else {}
    if isinstance(attn, GroupedQueryAttention):
        n_kv = attn.cfg.n_kv_heads
        kv = ColwiseParallel() if tp <= n_kv else ReplicatedKVHeads(n_kv, kv_views)
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


def mlp_plan(mlp: FeedForward, prefix: str = "") -> dict[str, ParallelStyle]:
    """w1 (and a gated MLP's w3) split over the hidden units, w2 over its inputs. The hidden activations stay
    DTensors between them, so a hidden size tp does not divide (split as torch.chunk does) keeps its true global
    shape. A plain MLP has no w3 (naming it, torch warned "could not be resolved" on every rank)."""
    p = prefix
    plan: dict[str, ParallelStyle] = {p.rstrip("."): _replicated_block_input()} if p else {}
    hidden = {"use_local_output": False}
    plan[f"{p}w1"] = ColwiseParallel(**hidden)
    if mlp.kind in GATED_MLPS:
        plan[f"{p}w3"] = ColwiseParallel(**hidden)
    return plan | {f"{p}w2": RowwiseParallel()}


def _check_mesh(mesh: DeviceMesh) -> int:
    """The mesh's size, once it is a mesh apply_tp can use: one dimension, holding this rank."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names
        fix = (
            f"pass the dimension to split heads over, {' or '.join(f'mesh[{n!r}]' for n in names)}"
            if names
            else "name its dimensions (init_device_mesh(..., mesh_dim_names=('dp', 'tp'))) and pass mesh['tp']"
        )
        raise ValueError(
            f"apply_tp splits heads over a 1-D mesh; got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}"
            f"{f' named {names}' if names else ''}: {fix}"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"apply_tp: rank {dist.get_rank()} is not in the mesh (ranks {mesh.mesh.tolist()}); pass the mesh, "
            "or the slice of a larger mesh, that holds this rank"
        )
    return mesh.size()


def _check_module(module: nn.Module, tp: int) -> None:
    """Everything apply_tp checks, before anything is sharded (no collective has been issued yet)."""
    if isinstance(module, (Transformer, GroupedQueryAttention, MultiHeadLatentAttention)):
        check_shardable(module.cfg, tp)
    elif isinstance(module, FeedForward):
        check_split_sizes({"hidden": module.w1.out_features}, tp, f"tp={tp}")
    else:
        raise TypeError(
            "apply_tp shards GroupedQueryAttention, MultiHeadLatentAttention, FeedForward and Transformer; "
            f"got {type(module).__name__}"
        )
    if any(isinstance(p, DTensor) for p in module.parameters()):
        raise ValueError("apply_tp: the module is already sharded (its parameters are DTensors)")


def apply_tp(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard ``module`` by heads over the 1-D ``mesh`` in place and return it (see the module docstring). Any 1-D
    mesh: ``init_device_mesh("cpu", (tp,))``, with or without ``mesh_dim_names``, or one dimension of a larger mesh
    (``mesh["tp"]``). Every rank of the mesh makes the same call.

    A sharded attention module takes and returns whole (B, T, d_model) tensors like the unsharded one; its
    ``n_heads`` / ``n_kv_heads`` and ``new_cache`` are this rank's. A ``Transformer`` also splits its embedding and
    output over the vocabulary (unless they are tied: then both stay whole) and returns whole logits.
    """
    tp = _check_mesh(mesh)
    _check_module(module, tp)
    if isinstance(module, FeedForward):
        return parallelize_module(module, mesh, {"": _replicated_block_input()} | mlp_plan(module))
    if not isinstance(module, Transformer):
        return parallelize_module(module, mesh, {"": _replicated_block_input()} | attention_plan(module, tp))
    kv_views: dict[int, DeviceMesh] = {}  # one (kv, rep) view of the mesh for all layers
    for layer in module.layers:
        plan = attention_plan(layer.attention, tp, "attention.", kv_views)
        parallelize_module(layer, mesh, plan | mlp_plan(layer.feed_forward, "feed_forward."))
    if not module.cfg.tie_embeddings:  # a tied table is one tensor: it cannot be split two ways
        parallelize_module(
            module,
            mesh,
            {
                "tok_embeddings": VocabParallelEmbedding(),
                "output": ColwiseParallel(output_layouts=Replicate()),
            },
        )
    return module
