"""Data parallelism on PyTorch's own engines, applied from outside the model and the loop.

``setup()`` reads what ``torchrun`` put in the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...),
starts the process group (NCCL on GPUs, gloo on CPUs) and names the mesh axes with ``init_device_mesh``: one axis
"dp", or with tensor parallelism (``tp`` > 1) a 2-D (dp, tp) mesh whose consecutive ranks form a tp group.
``parallelize`` wraps the model with ``DistributedDataParallel`` or, with ``fsdp``, shards every transformer block
and then the root with FSDP2's ``fully_shard`` (parameters, gradients and optimizer state split over the ranks; a
block's full weights exist only while it runs). With tp > 1 it first splits the heads over the "tp" axis
(``attnlab.parallel.apply_tp``); data parallelism over "dp" is then FSDP2 (torchtitan's 2-D FSDP + TP; DDP does not
take DTensor parameters). Ranks of one tp group read the same batch. Without torchrun everything is a no-op on one
process. Multi-node runs are torchrun's business: the same command under
``torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m attnlab uptrain ...``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import resources


@dataclass(frozen=True)
class Env:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: Any = None  # DeviceMesh with the axis "dp" (and "tp" when tp > 1), or None on one process
    owns_group: bool = False  # whether setup() started the process group (and teardown() ends it)
    tp: int = 1  # ranks that split each layer's heads (tensor parallelism)

    @property
    def is_main(self) -> bool:
        """Rank 0 logs and writes; every rank computes."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether collectives run: under torchrun (``setup`` made a mesh), never for ``ONE_PROCESS``."""
        return self.mesh is not None

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: groups of ``tp`` ranks that each read their own share of a batch."""
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp  # the (dp, tp) mesh is row-major: a tp group is tp consecutive ranks

    @property
    def dp_mesh(self) -> Any:
        return self.mesh["dp"] if self.tp > 1 else self.mesh


ONE_PROCESS = Env(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def setup(tp: int = 1, device: str = "auto") -> Env:
    """The process's place in the job (one process when not launched by torchrun); ``tp`` ranks split each layer.

    ``device`` is ``--device`` (``resources.resolve_device``). On one process it is the device used; under torchrun
    a CUDA device means one GPU per rank, ``cuda:LOCAL_RANK`` with NCCL, and the CPU means gloo."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_initialized():
        world = dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    chosen = resources.resolve_device(device)
    cuda = chosen.type == "cuda"
    several = world > 1 or "RANK" in os.environ or dist.is_initialized()
    if cuda and several:  # checked on every rank before any collective, so all of them stop
        if device.strip().lower() not in ("auto", "cuda"):
            raise ValueError(
                f"--device {device}: under torchrun each rank takes its own GPU, cuda:LOCAL_RANK; pass --device cuda"
            )
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"--device {device}: rank with LOCAL_RANK={local_rank} has no GPU of its own (this node shows "
                f"{torch.cuda.device_count()}): launch at most that many ranks per node"
            )
        chosen = torch.device("cuda", local_rank)
    if world % tp:  # checked on every rank before any collective, so all of them stop
        raise ValueError(
            f"--tp {tp} must divide the number of ranks ({world}); launch with torchrun --nproc-per-node "
            f"{tp} (or a multiple of it: the rest is data parallelism)"
        )
    if cuda:
        torch.cuda.set_device(chosen)  # kernels launched without a device (Triton, NCCL) go to this one
    if not several:
        return Env(rank=0, world_size=1, local_rank=0, device=chosen)
    owns = not dist.is_initialized()
    if owns:
        resources.die_with_launcher()
        dist.init_process_group(backend(chosen))
    from torch.distributed.device_mesh import init_device_mesh

    if tp == 1:
        mesh = init_device_mesh(chosen.type, (world,), mesh_dim_names=("dp",))
    else:
        mesh = init_device_mesh(chosen.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return Env(dist.get_rank(), world, local_rank, chosen, mesh, owns, tp)


def backend(device: torch.device) -> str:
    """The process group's backend for ranks on ``device``: NCCL between GPUs, gloo between CPUs."""
    return "nccl" if device.type == "cuda" else "gloo"


def teardown(env: Env) -> None:
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def uses_fsdp(env: Env, fsdp: bool) -> bool:
    """Whether data parallelism is FSDP2: asked for, or implied by tensor parallelism with several replicas."""
    return fsdp or (env.tp > 1 and env.dp_size > 1)


def _fully_shard(model: nn.Module, env: Env) -> nn.Module:
    if env.mesh is None:
        raise ValueError("--fsdp shards the model over ranks: launch with torchrun (see docs/uptraining.md)")
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:  # one all-gather per block, freed after it runs (torchtitan's plan)
        fully_shard(block, mesh=env.dp_mesh)
    return fully_shard(model, mesh=env.dp_mesh)


@contextlib.contextmanager
def quiet_redistribution() -> Iterator[None]:
    """DTensor's log line that a redistribution runs as two sequential all-reduces (a partial sum over "tp" and
    "dp" at once: a norm's, under ``--tp 2 --fsdp``), which every rank logged: correct, only not the fastest, and
    no news to a user. Through torch's logging, not a warning: its logger is quieted for as long as the run."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def parallelize(model: nn.Module, env: Env, *, fsdp: bool) -> nn.Module:
    """The model as the loop trains it: itself (one process), DDP, FSDP2-sharded (``fsdp``), or split by heads
    over the "tp" axis and then, with several data-parallel replicas, FSDP2-sharded over "dp"."""
    if env.tp > 1:
        from ..parallel import apply_tp

        apply_tp(model, env.mesh["tp"])
    if uses_fsdp(env, fsdp):
        if env.tp > 1:
            # Split by heads, the model returns the output head's gathered logits as DTensor.to_local() gives them: a
            # view, which FSDP2 warns may lose its pre-backward hook if changed in place. The loop only reads them
            # (cross-entropy, the distillation loss), so the warning, printed by every rank, is no news to a user.
            # The filter lasts as long as the run (train.loop.uptrain's warnings.catch_warnings).
            warnings.filterwarnings(
                "ignore", r"FSDP2-wrapped module \(FSDPTransformer\) returned a view tensor", UserWarning
            )
        return _fully_shard(model, env)
    if env.world_size == 1 or env.tp > 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)


def shard_frozen(model: nn.Module, env: Env, *, fsdp: bool) -> nn.Module:
    """A model that only runs forward (the distillation teacher): FSDP2-sharded over "dp" when the student is,
    else a full copy per rank (DDP has nothing to synchronise without gradients; its heads are not split)."""
    return _fully_shard(model, env) if uses_fsdp(env, fsdp) else model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 shards in place, so there is nothing to unwrap)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Around a micro-step's forward and backward: reduce gradients over ranks only when ``enabled`` (the
    last micro-step of an accumulation); the others just accumulate locally (DDP ``no_sync``)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        with contextlib.nullcontext() if enabled else model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        yield
    else:
        yield


def any_rank(flag: bool, env: Env) -> bool:
    """Whether ``flag`` holds on any rank (tensor-parallel ranks included: each holds other shards)."""
    if not env.distributed:
        return flag
    x = torch.tensor([float(flag)], device=env.device)
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return bool(x.item() > 0)


def all_reduce_sum(x: torch.Tensor, env: Env) -> torch.Tensor:
    """Sum of ``x`` over the data-parallel replicas (``x`` itself on one process); the ranks of a tp group hold the
    same value, which is counted once."""
    if env.distributed:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=env.dp_mesh.get_group() if env.tp > 1 else None)
    return x


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their total 2-norm is at most ``max_norm``; returns the norm before (a plain
    tensor). Unlike ``torch.nn.utils.clip_grad_norm_``, the gradients may be DTensors on different meshes (tensor
    parallelism puts weights on "tp", on a (kv, rep) view of it and, with FSDP2, on "dp" too): each mesh's norm is
    completed with one collective, and only the plain sums of squares are combined."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).double() ** 2)
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros((), dtype=torch.float64)
    coef = min(1.0, max_norm / (float(total) + 1e-6))  # the epsilon of torch's clip_grad_norm_
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total.float()


def broadcast_object(obj: Any, env: Env) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# What rank 0's failure is raised as on the other ranks: the nearest of these in the error's class hierarchy.
_SHARED_ERRORS = (FileNotFoundError, FileExistsError, OSError, ValueError, TypeError, MemoryError)


def on_main(fn: Callable[[], Any], env: Env) -> Any:
    """``fn()`` run on rank 0 alone (a decision about files only rank 0 touches); its result, or its error, reaches
    every rank. A user error on rank 0 is raised on every rank with the same message, so that all of them stop
    (and only rank 0 reports it, see ``attnlab.cli``)."""
    if not env.distributed:
        return fn()
    box: tuple = ()
    if env.is_main:
        try:
            box = ("ok", fn())
        except _SHARED_ERRORS as err:
            box = ("error", next(c.__name__ for c in _SHARED_ERRORS if isinstance(err, c)), str(err), err)
    verdict = broadcast_object(box[:3] if env.is_main else None, env)
    if verdict[0] == "ok":
        return verdict[1]
    if env.is_main:
        raise box[3]
    raise {c.__name__: c for c in _SHARED_ERRORS}[verdict[1]](verdict[2])


def gather_objects(obj: Any, env: Env) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(env: Env) -> None:
    if env.distributed:
        dist.barrier()
