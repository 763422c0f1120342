"""Reading and writing Hugging Face checkpoint directories: config.json + safetensors, atomic writes.

Only safetensors are read (a pickled ``pytorch_model.bin`` can run code when loaded). Weights may be one
``model.safetensors`` or shards listed by ``model.safetensors.index.json``; a written checkpoint keeps the
source's shard layout. A destination is built in a temporary sibling directory and renamed into place, so a
failed or interrupted write leaves no partial checkpoint behind.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_config(src: str | Path) -> dict:
    """config.json of a checkpoint directory, checked to be a JSON object with a ``model_type``."""
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {src}")
    path = src / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {src}")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"malformed {path}: {err}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"malformed {path}: expected a JSON object, got {type(cfg).__name__}")
    if not isinstance(cfg.get("model_type"), str):
        raise ValueError(f"{path} has no model_type field")
    return cfg


def shard_map(src: str | Path) -> dict[str, str]:
    """Tensor name -> safetensors file name (relative to ``src``)."""
    src = Path(src)
    if (src / INDEX).is_file():
        try:
            weight_map = json.loads((src / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"malformed {src / INDEX}: {err}") from None
        for name in set(weight_map.values()):
            if not (src / name).is_file():
                raise ValueError(f"{src / INDEX} lists {name}, which is missing")
        return dict(weight_map)
    if (src / SINGLE).is_file():
        with safe_open(src / SINGLE, framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE)
    pickled = sorted(p.name for p in src.glob("*.bin")) + sorted(p.name for p in src.glob("*.pt"))
    if pickled:
        raise ValueError(f"only safetensors checkpoints are read; {src} has {', '.join(pickled)}")
    raise ValueError(f"no {SINGLE} or {INDEX} in {src}")


def read_tensors(src: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of a checkpoint and its shard map."""
    src = Path(src)
    files = shard_map(src)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(files.values())):
        with safe_open(src / name, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[key] = f.get_tensor(key)
    missing = set(files) - set(tensors)
    if missing:
        raise ValueError(f"{src}: the index lists tensors no shard holds: {sorted(missing)[:5]}")
    return tensors, files


def write_tensors(dst: Path, tensors: dict[str, torch.Tensor], files: dict[str, str] | None = None) -> None:
    """Save ``tensors`` into ``dst`` with the shard layout ``files`` (default: one model.safetensors)."""
    files = files or dict.fromkeys(tensors, SINGLE)
    if set(files) != set(tensors):
        raise ValueError("write_tensors: the shard map and the tensors name different keys")
    for name in sorted(set(files.values())):
        shard = {k: tensors[k].contiguous() for k, f in files.items() if f == name}
        save_file(shard, str(dst / name), metadata={"format": "pt"})
    if len(set(files.values())) > 1 or SINGLE not in files.values():
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(files.items()))}
        (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def write_config(dst: Path, cfg: dict) -> None:
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def copy_other_files(src: Path, dst: Path, skip: set[str]) -> None:
    """Copy everything in ``src`` except the names in ``skip`` (tokenizer, generation config, ...) unchanged."""
    for path in src.iterdir():
        if path.name in skip:
            continue
        if path.is_dir():
            shutil.copytree(path, dst / path.name)
        else:
            shutil.copy2(path, dst / path.name)


@contextlib.contextmanager
def atomic_dir(dst: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``dst`` when the block succeeds (removed if it fails)."""
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"destination exists: {dst} (pass --overwrite / overwrite=True to replace it)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        yield tmp
        if dst.exists():  # overwrite: move the old one aside first, so dst is never half-written
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            dst.rename(old / dst.name)
            tmp.rename(dst)
            shutil.rmtree(old)
        else:
            tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
