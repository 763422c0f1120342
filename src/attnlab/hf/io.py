"""Reading and writing Hugging Face checkpoint directories: config.json + safetensors, atomic writes.

Only safetensors are read (a pickled ``pytorch_model.bin`` can run code when loaded). Weights may be one
``model.safetensors`` or shards listed by ``model.safetensors.index.json``; a written checkpoint keeps the
source's shard layout. A destination is written with ``attnlab.atomic.atomic_dir`` (re-exported here): built in a
temporary sibling directory and renamed into place, so a failed or interrupted write leaves no partial checkpoint.

A file that is not a readable safetensors file (empty, truncated, corrupt) is a ``ValueError`` naming it; a
failed write (disk full, permission) is an ``OSError`` naming the destination.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..atomic import atomic_dir as atomic_dir  # the writer of every checkpoint directory (re-exported)
from ..atomic import named, read_json
from ..hf_config import quantization

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Files that hold weights in some framework's format (PyTorch pickles, safetensors, GGUF/GGML, TensorFlow,
# Flax, ONNX, rust-bert, NumPy). A converted checkpoint must not carry the source's copies of them.
WEIGHT_SUFFIXES = (
    ".bin", ".pt", ".pth", ".ckpt", ".safetensors", ".gguf", ".ggml", ".h5", ".msgpack", ".onnx", ".onnx_data",
    ".ot", ".npz", ".tflite",
)  # fmt: skip
# Directories of tools, not of the model: git metadata and huggingface_hub's download cache (whose hashes
# describe the source's files).
TOOL_DIRS = (".git", ".cache")
# What `attnlab uptrain` writes beside the weights about its run (train/loop.py): they describe the training of the
# source, not the model a conversion writes.
RUN_RECORDS = ("uptrain.json", "uptrain_log.jsonl")


def _open(path: Path) -> Any:
    """``safe_open`` with a ValueError naming the file when it is not a readable safetensors file."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:  # the file is fine: its path is what the library cannot take
        raise ValueError(
            f"{str(path)!r}: the path is not valid UTF-8 text, which the safetensors library cannot open; rename "
            "the directory"
        ) from None
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as err:
        raise ValueError(
            f"{path} is not a readable safetensors file ({err}); re-download or re-export it"
        ) from None


def read_config(src: str | Path) -> dict:
    """config.json of a checkpoint directory, checked to be a JSON object with a ``model_type``."""
    src = Path(src)
    if not src.is_dir():
        if src.exists():  # "not found" sent users looking for a path that was there
            raise ValueError(f"{src} is a file, not a checkpoint directory (config.json + safetensors)")
        raise FileNotFoundError(f"checkpoint directory not found: {named(src)}")
    path = src / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {src}")
    cfg = read_json(path)
    if not isinstance(cfg.get("model_type"), str):
        raise ValueError(f"{path} has no model_type field")
    # a quantized checkpoint's tensors are packed integers or scaled fp8, not the weights themselves
    method = quantization(cfg)
    if method is not None:
        raise ValueError(f"{path}: quantization_config ({method}): attnlab reads unquantized weights (float32, "
                         "float16, bfloat16); dequantize the checkpoint first")  # fmt: skip
    return cfg


def shard_map(src: str | Path) -> dict[str, str]:
    """Tensor name -> safetensors file name (relative to ``src``). A single ``model.safetensors`` is read before an
    index, as transformers reads them (its ``save_pretrained`` over a sharded save leaves the old index behind)."""
    src = Path(src)
    if (src / SINGLE).is_file():
        with _open(src / SINGLE) as f:
            return dict.fromkeys(f.keys(), SINGLE)
    if (src / INDEX).is_file():
        index = read_json(src / INDEX)
        if not isinstance(index.get("metadata") or {}, dict):  # met at the final write, after the work
            raise ValueError(f"malformed {src / INDEX}: metadata must be a JSON object")
        if "weight_map" not in index:
            raise ValueError(f"malformed {src / INDEX}: no weight_map")
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError(f"malformed {src / INDEX}: weight_map must map tensor names to file names")
        for name in set(weight_map.values()):
            if Path(name).name != name:
                raise ValueError(f"{src / INDEX} lists {name!r}, which is not a file name in {src}")
            if not (src / name).is_file():
                raise ValueError(f"{src / INDEX} lists {name}, which is missing")
        return dict(weight_map)
    pickled = sorted(p.name for p in src.glob("*.bin")) + sorted(p.name for p in src.glob("*.pt"))
    if pickled:
        raise ValueError(f"only safetensors checkpoints are read; {src} has {', '.join(pickled)}")
    raise ValueError(f"no {SINGLE} or {INDEX} in {src}")


# The weight dtypes attnlab reads, by safetensors' names (a fp8 or other quantized tensor is not a weight to it).
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def check_weights(src: str | Path) -> dict[str, torch.Tensor]:
    """The checks a load makes of a checkpoint's weight files, on their headers alone (nothing is read): every
    shard readable, every tensor of a float dtype (a buffer such as GPT-NeoX's boolean mask aside). For commands
    that load the weights only in their jobs (``attnlab sweep``, whose rows each failed on a truncated file, with
    exit 0). Returns the tensors as the headers describe them, on the meta device (no memory)."""
    src = Path(src)
    meta = {}
    for name in sorted(set(shard_map(src).values())):
        with _open(src / name) as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                piece = f.get_slice(key)
                dtype = piece.get_dtype()
                if dtype not in FLOAT_DTYPES and dtype != "BOOL":
                    raise ValueError(
                        f"{src / name}: tensor {key} has dtype {dtype}; attnlab reads float16, bfloat16, float32 "
                        "and float64 weights"
                    )
                meta[key] = torch.empty(
                    piece.get_shape(), dtype=FLOAT_DTYPES.get(dtype, torch.bool), device="meta"
                )
    return meta


def read_tensors(src: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of a checkpoint and its shard map."""
    src = Path(src)
    files = shard_map(src)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(files.values())):
        with _open(src / name) as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                try:
                    tensors[key] = f.get_tensor(key)
                except SafetensorError as err:
                    raise ValueError(f"{src / name}: tensor {key!r} cannot be read ({err})") from None
    missing = set(files) - set(tensors)
    if missing:
        raise ValueError(f"{src}: the index lists tensors no shard holds: {sorted(missing)[:5]}")
    return tensors, files


def _numel(src: Path) -> int:
    """The values held by the weight files of checkpoint ``src``, from their headers."""
    total = 0
    for name in sorted(set(shard_map(src).values())):
        with _open(src / name) as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                total += math.prod(f.get_slice(key).get_shape())
    return total


def write_tensors(
    dst: Path, tensors: dict[str, torch.Tensor], files: dict[str, str] | None = None, like: Path | None = None
) -> None:
    """Save ``tensors`` into ``dst`` with the shard layout ``files`` (default: one model.safetensors). ``like``: the
    checkpoint whose files these replace: each file keeps its metadata (a license, an origin), the index its own."""
    files = files or dict.fromkeys(tensors, SINGLE)
    if set(files) != set(tensors):
        raise ValueError("write_tensors: the shard map and the tensors name different keys")
    for name in sorted(set(files.values())):
        kept = {}
        if like is not None and (like / name).is_file():
            with _open(like / name) as f:
                kept = f.metadata() or {}
        save_safetensors({k: tensors[k] for k, f in files.items() if f == name}, dst / name, kept)
    if len(set(files.values())) > 1 or SINGLE not in files.values():
        meta = {}
        if like is not None and (like / INDEX).is_file():
            with contextlib.suppress(ValueError, AttributeError):
                meta = dict(json.loads((like / INDEX).read_text()).get("metadata") or {})
        meta["total_size"] = sum(t.numel() * t.element_size() for t in tensors.values())
        if isinstance(meta.get("total_parameters"), int):
            # transformers 5 writes it, counting parameters (a tied head once, no buffers): the source's count,
            # moved by what the written tensors add or remove (a conversion's smaller k/v projections)
            meta["total_parameters"] += sum(t.numel() for t in tensors.values()) - _numel(like)
        index = {"metadata": meta, "weight_map": dict(sorted(files.items()))}
        (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """``safetensors.torch.save_file`` (``metadata`` beside its "format": "pt"), with a failed write (disk full, a
    file-size limit) as an ``OSError``."""
    try:
        meta = {**(metadata or {}), "format": "pt"}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)
    except SafetensorError as err:  # the Rust writer reports I/O errors as "... (os error N)"
        code = re.search(r"os error (\d+)", str(err))
        number = int(code.group(1)) if code else errno.EIO
        raise OSError(number, os.strerror(number), str(path)) from err


def write_config(dst: Path, cfg: dict) -> None:
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def write_checkpoint(
    dst: str | Path, tensors: dict[str, torch.Tensor], config: dict, overwrite: bool = False
) -> Path:
    """A new checkpoint directory of any family: ``tensors`` in one model.safetensors and ``config`` as config.json,
    written atomically (the one save body behind ``save_model``, ``save_llama``, ``save_deepseek`` and
    ``export_bert_mha``). Returns ``dst``."""
    with atomic_dir(dst, overwrite) as tmp:
        write_tensors(tmp, tensors)
        write_config(tmp, config)
    return Path(dst)


M = TypeVar("M", bound=torch.nn.Module)


def _some(names: list[str], shown: int = 4) -> str:
    """Up to ``shown`` names, and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{', '.join(names[:shown])}{more}"


def assign(
    src: str | Path,
    build: Callable[[], M],
    state: dict[str, torch.Tensor],
    theirs: Callable[[str], str] | None = None,
) -> M:
    """The module ``build()`` makes (on the meta device, so nothing is allocated twice) holding the tensors of
    ``state`` read from ``src``: its key set must be exactly the module's and each shape its parameter's, else a
    ValueError naming what differs, by the checkpoint's own tensor names where ``theirs`` maps attnlab's to them
    (the family's ``TensorMap.theirs``). The one load body behind every family's loader (causal LMs and BERT)."""
    theirs = theirs or str
    with torch.device("meta"):
        model = build()
    expected = model.state_dict()
    if set(state) != set(expected):
        missing = sorted(dict.fromkeys(theirs(n) for n in expected if n not in state))
        extra = sorted(dict.fromkeys(theirs(n) for n in state if n not in expected))
        said = [f"missing {_some(missing)}"] * bool(missing) + [f"not in its model: {_some(extra)}"] * bool(
            extra
        )
        raise ValueError(f"{src}: the checkpoint's tensors do not match its config.json: {'; '.join(said)}")
    # float8 failed in check_finite; complex64 loaded, and failed later
    for name, _ in model.named_parameters():
        if state[name].dtype not in FLOAT_DTYPES.values():
            raise ValueError(
                f"{src}: weight {theirs(name)} has dtype {state[name].dtype}; attnlab reads float16, bfloat16, "
                "float32 and float64 weights (an fp8 or other quantized checkpoint: dequantize it first)"
            )
    # a tensor whose shape contradicts config.json (torch's message named attnlab's names, every layer on one line)
    wrong = list(
        dict.fromkeys(  # a tied head is its embedding: said once
            f"{theirs(n)} {tuple(state[n].shape)} where config.json gives {tuple(t.shape)}"
            for n, t in expected.items()
            if state[n].shape != t.shape
        )
    )
    if wrong:
        raise ValueError(f"{src}: tensors do not match config.json: {_some(wrong, 2)}")
    model.load_state_dict(state, assign=True)
    return model


def is_weight_file(name: str) -> bool:
    """A weight file of some framework, or the index of one (``pytorch_model.bin.index.json``)."""
    return name.endswith(WEIGHT_SUFFIXES) or (
        name.endswith(".index.json") and name[: -len(".index.json")].endswith(WEIGHT_SUFFIXES)
    )


def files_id(src: str | Path, only: Callable[[str], bool] = lambda name: True, salt: str = "") -> str:
    """What the files of directory ``src`` (those ``only`` takes, by name) are, without reading gigabytes: their
    names, sizes and modification times, after ``salt``."""
    h = hashlib.sha256(salt.encode())
    for p in sorted(Path(src).iterdir()):
        if p.is_file() and only(p.name):
            st = p.stat()
            h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:16]


def weights_id(src: str | Path) -> str:
    """What a checkpoint's weights are (``files_id`` of its weight files): a model written again to the same path,
    by a conversion or a training run, is another one."""
    return files_id(src, is_weight_file)


def copy_other_files(src: Path, dst: Path | None, skip: set[str] = frozenset()) -> list[str]:
    """Copy everything in ``src`` except the names in ``skip`` (tokenizer, generation config, ...) unchanged.

    Weight files (``WEIGHT_SUFFIXES``, their indexes), tool directories (``TOOL_DIRS``), an uptraining's records
    (``RUN_RECORDS``) and linked directories (not followed: one could lead anywhere, the source itself included) are
    never copied: the first three hold or describe the source's weights, which the written ones replace. Returns
    those left out (relative paths). Files are copied by content (a symlink, as in a Hugging Face cache snapshot,
    yields its target); a broken link is refused naming it. ``dst`` None: only the checks, before any work.
    """
    left_out: list[str] = []

    def walk(src_dir: Path, dst_dir: Path | None, rel: str) -> None:
        for path in sorted(src_dir.iterdir()):
            name = rel + path.name
            if not rel and path.name in skip:
                continue
            if path.is_symlink() and not path.exists():
                raise ValueError(
                    f"{path}: a broken symbolic link (to {os.readlink(path)}) among the source's files"
                )
            if path.is_dir() and (path.name in TOOL_DIRS or path.is_symlink()):
                left_out.append(name + "/")
            elif path.is_dir():
                if dst_dir is not None:
                    (dst_dir / path.name).mkdir()
                walk(path, None if dst_dir is None else dst_dir / path.name, name + "/")
            elif is_weight_file(path.name) or (not rel and path.name in RUN_RECORDS):
                left_out.append(name)
            # a FIFO, a socket, a device (or a link to one): a link to /dev/zero was copied until the disk filled
            elif not path.is_file():
                raise ValueError(
                    f"{path}: not a regular file (a pipe, socket or device) among the source's files"
                )
            elif not os.access(path, os.R_OK):  # met at the final write, after the work, naming DST
                raise ValueError(f"{path}: the source's file cannot be read (permission denied)")
            elif dst_dir is not None:
                shutil.copyfile(path, dst_dir / path.name)

    walk(src, dst, "")
    return left_out


def check_finite(model: torch.nn.Module, src: str | Path, theirs: Callable[[str], str] | None = None) -> None:
    """Refuse a model with a NaN or inf weight: it would be averaged into every head of its group by a conversion,
    make every loss NaN in training and evaluation, and turn generation into empty text. ``theirs``: as
    ``assign``'s."""
    for name, p in model.named_parameters():
        if p.is_floating_point() and not bool(torch.isfinite(p).all()):
            raise ValueError(
                f"{src}: the checkpoint's tensor {(theirs or str)(name)} holds NaN or inf values; a damaged (or "
                "diverged) checkpoint cannot be converted, trained, evaluated or sampled"
            )
