"""Training checkpoints: one directory per checkpoint, written atomically, holding everything needed to continue.

Until a run finishes, nothing is written to DST; its state lives in the run directory (``DST.run`` beside DST,
or ``--run-dir``)::

    DST.run/
      log.jsonl                  one JSON line per optimizer step (rank 0)
      step-00000200/             a complete checkpoint (renamed into place only once fully written)
        model.safetensors        the whole model, float32, attnlab names (trained and frozen parameters)
        optimizer.safetensors    AdamW moments and step counts, "<parameter name>::<state name>"
        optimizer.json           parameter groups: hyper-parameters and the parameter names in each
        rng.json                 per rank: torch (and CUDA), numpy and python RNG states
        state.json               step, samples consumed, world size, the options of the run
      .step-00000300.tmp-XXXX/   a checkpoint being written, or left by a kill: never read, removed on resume

The run directory is attnlab's (it carries the ``.attnlab`` marker of kind "run", see ``attnlab.atomic``): an
existing directory without the marker is never used, emptied or deleted. When DST is written (atomically, see
``attnlab.hf.causal_lm.save_causal_lm``) the run directory is deleted. A killed run leaves a run directory and no
DST; ``--resume`` continues from its newest complete checkpoint.

Model and optimizer states go through ``torch.distributed.checkpoint.state_dict`` in their full (unsharded)
form, so one code path serves one process, DDP and FSDP2, and a checkpoint can be resumed on another number of
ranks. Only rank 0 reads and writes files; the others receive what they need by broadcast. Nothing here is
pickled: tensors are safetensors, the rest JSON.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from ..atomic import added, atomic_dir, read_json, remove_or_keep
from ..hf.io import _open, save_safetensors
from .distributed import Env, barrier, broadcast_object, gather_objects

MODEL = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
_STEP_DIR = re.compile(r"step-(\d{8})")


def _options(env: Env, *, loading: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if loading:
        return StateDictOptions(full_state_dict=True, broadcast_from_rank0=env.distributed)
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON-able values."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [name, keys.tolist(), pos, has_gauss, gauss],
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def _flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for name, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}::{key}"] = value.detach().contiguous()
            else:
                scalars[f"{name}::{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[str, dict[str, Any]] = {}
    for flat, value in [*tensors.items(), *meta["scalars"].items()]:
        name, _, key = flat.rpartition("::")
        state.setdefault(name, {})[key] = value
    groups = [
        {k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in group.items()}
        for group in meta["param_groups"]
    ]  # JSON turned tuples (AdamW's betas) into lists
    return {"state": state, "param_groups": groups}


_ALIASES = "attnlab_aliases"  # model.safetensors' metadata: {name: the stored tensor it shares memory with}


def _unshared(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors sharing memory (tied embeddings): each stored once, and the other names as
    aliases of it (a copy stored the embedding table twice, ~113 MB a checkpoint for a 49,152 x 576 one)."""
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    out, aliases = {}, {}
    for name, value in state.items():
        value = value.detach()
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride())
        if key in seen:  # the same tensor under another name
            aliases[name] = seen[key]
            continue
        seen[key] = name
        out[name] = value.contiguous()
    return out, aliases


def _with_aliases(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model state read back: each alias (``_unshared``) the tensor it names."""
    with _open(path) as f:
        aliases = json.loads((f.metadata() or {}).get(_ALIASES, "{}"))
    return tensors | {name: tensors[kept] for name, kept in aliases.items()}


def checkpoints(run: Path) -> list[Path]:
    """The complete checkpoints in a run directory, oldest first."""
    if not run.is_dir():
        return []
    found = [
        p
        for p in run.iterdir()
        if p.is_dir() and _STEP_DIR.fullmatch(p.name) and (p / "state.json").is_file()
    ]
    return sorted(found, key=lambda p: p.name)


_KEPT: set[Path] = set()  # checkpoints that rotation left for the files a user added (each said once)


def save_checkpoint(
    run: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, env: Env, meta: dict, keep: int
) -> Path:
    """Write checkpoint ``step`` (a collective: every rank calls it) and keep only the newest ``keep``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_state = get_model_state_dict(model, options=_options(env, loading=False))
    optim_state = get_optimizer_state_dict(model, optimizer, options=_options(env, loading=False))
    rngs = gather_objects(rng_state(), env)
    path = run / f"step-{step:08d}"
    if env.is_main:
        tensors, optim_meta = _flatten_optimizer(optim_state)
        with atomic_dir(path, overwrite=True) as tmp:
            tensors_of_model, aliases = _unshared(model_state)
            save_safetensors(tensors_of_model, tmp / MODEL, {_ALIASES: json.dumps(aliases)})
            save_safetensors(tensors, tmp / OPTIMIZER)
            (tmp / "optimizer.json").write_text(json.dumps(optim_meta, indent=1) + "\n")
            (tmp / "rng.json").write_text(json.dumps(rngs) + "\n")
            (tmp / "state.json").write_text(json.dumps(meta | {"step": step}, indent=2) + "\n")
        for old in checkpoints(run)[:-keep]:  # one a user put files in is kept (said once): training goes on
            remove_or_keep(old, "checkpoint", said=_KEPT)
    barrier(env)
    return path


def remove_partial(run: Path) -> None:
    """Delete checkpoints that were being written or deleted when a run died (hidden ``.step-*.tmp-*`` and
    ``.step-*.del-*`` directories): the run directory has one writer (its lock), so none of them is in use now."""
    if run.is_dir():
        for pattern in (".step-*.tmp-*", ".step-*.del-*"):
            for path in run.glob(pattern):
                shutil.rmtree(path, ignore_errors=True)


def start_over(run: Path) -> str:
    """How to start a run over in run directory ``run``: --overwrite empties it, but not while it holds what a
    user added (``atomic.added``), and advice that is then refused sends the user round in a circle."""
    named = added(run)  # "" for a directory without a user's file, or none at all
    if named:
        return (
            f"to start over, first move away what attnlab did not write there ({named}) and pass --overwrite"
        )
    return "pass --overwrite to start over"


def read_state(path: Path) -> dict:
    state = read_json(path / "state.json")
    if not (isinstance(state.get("options"), dict) and isinstance(state.get("step"), int)
            and isinstance(state.get("global_batch"), int)):  # fmt: skip
        raise ValueError(f"malformed {path / 'state.json'}: no step and options of a run")
    return state


def verify(path: Path) -> dict:
    """Checkpoint ``path``'s state.json, after checking that every file a resume reads is what it should be: a
    truncated safetensors or a damaged JSON was a traceback (or an AttributeError) after the setup. A ValueError
    names the file and what to do."""
    try:
        state = read_state(path)
        for name in (MODEL, OPTIMIZER):
            with _open(path / name):
                pass
        read_json(path / "optimizer.json")
        rngs = read_json(path / "rng.json", list)
        size = torch.get_rng_state().numel()  # a state of another size: torch's RuntimeError at the restore
        if not rngs or not all(isinstance(r, dict) and len(r.get("torch") or ()) == size for r in rngs):
            raise ValueError(f"malformed {path / 'rng.json'}: expected a list of RNG states")
    except ValueError as err:
        raise ValueError(
            f"--resume: the newest checkpoint is damaged ({err}); delete {path} to resume from the one before, "
            f"or {start_over(path.parent)}"
        ) from None
    return state


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, env: Env) -> dict:
    """Restore model, optimizer and this rank's RNG from checkpoint ``path``; returns its state.json."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model_state: dict = {}
    optim_state: dict = {}
    if env.is_main:
        model_state = _with_aliases(path / MODEL, load_file(str(path / MODEL)))
        optim_state = _unflatten_optimizer(
            load_file(str(path / OPTIMIZER)), read_json(path / "optimizer.json")
        )
    options = _options(env, loading=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)
    state, rngs = broadcast_object(
        (read_state(path), read_json(path / "rng.json", list)) if env.is_main else None, env
    )
    set_rng_state(rngs[env.rank % len(rngs)])
    return state
