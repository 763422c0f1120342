"""Data parallelism on PyTorch's own engines, applied from outside the model and the loop.

``setup()`` reads what ``torchrun`` put in the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...),
starts the process group (NCCL on GPUs, gloo on CPUs) and names the one mesh axis "dp" with
``init_device_mesh``. ``parallelize`` wraps the model with ``DistributedDataParallel`` or, with ``fsdp``, shards
every transformer block and then the root with FSDP2's ``fully_shard`` (parameters, gradients and optimizer
state split over the ranks; a block's full weights exist only while it runs). Without torchrun everything is a
no-op on one process. Multi-node runs are torchrun's business: the same command under
``torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m attnlab uptrain ...``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Env:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: Any = None  # DeviceMesh with the axis "dp", or None on one process
    owns_group: bool = False  # whether setup() started the process group (and teardown() ends it)

    @property
    def is_main(self) -> bool:
        """Rank 0 logs and writes; every rank computes."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether collectives run: under torchrun (``setup`` made a mesh), never for ``ONE_PROCESS``."""
        return self.mesh is not None


ONE_PROCESS = Env(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def setup() -> Env:
    """The process's place in the job (one process when not launched by torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if world == 1 and "RANK" not in os.environ and not dist.is_initialized():
        return Env(rank=0, world_size=1, local_rank=0, device=device)
    owns = not dist.is_initialized()
    if owns:
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    return Env(dist.get_rank(), dist.get_world_size(), local_rank, device, mesh, owns)


def teardown(env: Env) -> None:
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def parallelize(model: nn.Module, env: Env, *, fsdp: bool) -> nn.Module:
    """The model as the loop trains it: itself (one process), DDP, or FSDP2-sharded (``fsdp``)."""
    if fsdp:
        if env.mesh is None:
            raise ValueError(
                "--fsdp shards the model over ranks: launch with torchrun (see docs/uptraining.md)"
            )
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:  # one all-gather per block, freed after it runs (torchtitan's plan)
            fully_shard(block, mesh=env.mesh)
        return fully_shard(model, mesh=env.mesh)
    if env.world_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)


def shard_frozen(model: nn.Module, env: Env, *, fsdp: bool) -> nn.Module:
    """A model that only runs forward (the distillation teacher): sharded like the student under FSDP, else
    a full copy per rank (DDP has nothing to synchronise without gradients)."""
    return parallelize(model, env, fsdp=True) if fsdp else model


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


def all_reduce_sum(x: torch.Tensor, env: Env) -> torch.Tensor:
    """Sum of ``x`` over the ranks (``x`` itself on one process)."""
    if env.distributed:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def broadcast_object(obj: Any, env: Env) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
