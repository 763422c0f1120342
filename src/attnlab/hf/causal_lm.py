"""Causal-LM checkpoints of every supported family behind two functions, dispatched on config.json's
``model_type``: ``load_causal_lm(src)`` gives an attnlab model, ``save_causal_lm(state, cfg, dst, like=src)``
writes new weights as a checkpoint of the same kind as ``src``.

A family is a loader plus the map from attnlab state-dict names to the checkpoint's tensor names: Llama,
Mistral and Qwen2 (``attnlab.hf.llama``, GQA/MHA) and dense DeepSeek-V3 (``attnlab.hf.deepseek``, MLA: what
``attnlab convert --to mla`` writes). Another family is one more entry in ``FAMILIES``; training, evaluation and
the CLI pick it up without change.

``save_causal_lm`` writes a checkpoint *like* a source: the same config.json, tensor names, dtypes and shard
files, every other file (tokenizer, generation config) copied, only the weight values new. That is what
training needs: the architecture is the source's and only the values moved. Tensors of the source that no
attnlab parameter maps to (buffers such as ``rotary_emb.inv_freq``, which the loaders skip) are copied unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from . import deepseek, io, llama

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


@dataclass(frozen=True)
class Family:
    load: Callable[[Path], nn.Module]  # checkpoint directory -> attnlab model (eval mode)
    # (state dict, model cfg, the checkpoint's config.json) -> the checkpoint's tensors
    to_hf: Callable[[dict[str, torch.Tensor], Any, dict], dict[str, torch.Tensor]]


def _llama_to_hf(state: dict[str, torch.Tensor], cfg: Any, hf: dict) -> dict[str, torch.Tensor]:
    return llama.state_dict_to_hf(state, cfg)  # Hugging Face's Llama layout is always half-split


def _deepseek_to_hf(state: dict[str, torch.Tensor], cfg: Any, hf: dict) -> dict[str, torch.Tensor]:
    return deepseek.state_dict_to_hf(state, cfg, rope_interleave=hf.get("rope_interleave", True))


FAMILIES: dict[str, Family] = {
    model_type: Family(load=llama.load_llama, to_hf=_llama_to_hf) for model_type in llama.ARCHITECTURES
} | {"deepseek_v3": Family(load=deepseek.load_deepseek, to_hf=_deepseek_to_hf)}


def family_of(src: str | Path) -> str:
    """The ``model_type`` of a checkpoint directory, checked to be a causal-LM family attnlab handles."""
    return _family(io.read_config(src), src)


def _family(hf: dict, src: str | Path) -> str:
    model_type = hf["model_type"]
    if model_type not in FAMILIES:
        raise ValueError(
            f"unsupported model_type {model_type!r} in {Path(src) / 'config.json'}; causal-LM families: "
            f"{', '.join(FAMILIES)}"
        )
    return model_type


def load_causal_lm(src: str | Path) -> nn.Module:
    """The attnlab model of a causal-LM checkpoint (weights keep the checkpoint's dtype), checked to hold only
    finite weights."""
    model = FAMILIES[family_of(src)].load(Path(src))
    io.check_finite(model, src)
    return model


def _tensor_meta(src: Path, files: dict[str, str]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    meta = {}
    for name in sorted(set(files.values())):
        with safe_open(src / name, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                piece = f.get_slice(key)
                dtype = piece.get_dtype()
                if dtype not in _DTYPES:
                    raise ValueError(f"{src / name}: tensor {key} has dtype {dtype}, not a float type")
                meta[key] = (_DTYPES[dtype], tuple(piece.get_shape()))
    return meta


def save_causal_lm(
    state: dict[str, torch.Tensor],
    cfg: Any,
    dst: str | Path,
    *,
    like: str | Path,
    overwrite: bool = False,
    extra_files: dict[str, str] | None = None,
    sources: tuple[str | Path | None, ...] = (),
) -> Path:
    """Write the attnlab state dict ``state`` (of a model with config ``cfg``) as a checkpoint like ``like``.

    ``extra_files``: name -> text written beside the weights (e.g. a training log). Atomic: ``dst`` appears
    complete or not at all. ``sources``: inputs besides ``like`` that ``dst`` may not be, contain or lie inside.
    Returns ``dst``.
    """
    like, dst = Path(like), Path(dst)
    hf = io.read_config(like)
    new = FAMILIES[_family(hf, like)].to_hf(state, cfg, hf)
    files = io.shard_map(like)
    meta = _tensor_meta(like, files)
    unknown = sorted(set(new) - set(files))
    if unknown:
        raise ValueError(f"{like} has no tensors {unknown[:4]}: the model does not have its architecture")
    tensors: dict[str, torch.Tensor] = {}
    kept = {}
    for key in files:
        dtype, shape = meta[key]
        if key not in new:
            kept[key] = files[key]
            continue
        if tuple(new[key].shape) != shape:
            raise ValueError(f"tensor {key}: shape {tuple(new[key].shape)}, but {like} has {shape}")
        tensors[key] = new[key].detach().to("cpu", dtype).contiguous()
    for name in sorted(set(kept.values())):  # buffers the loaders skip: copied as they are
        with safe_open(like / name, framework="pt") as f:
            for key in (k for k, v in kept.items() if v == name):
                tensors[key] = f.get_tensor(key)
    weight_files = set(files.values()) | {io.INDEX}
    with io.atomic_dir(dst, overwrite, sources=(like, *sources), what="DST") as tmp:
        io.write_tensors(tmp, tensors, files)
        # config.json, tokenizer files, generation config: unchanged.
        io.copy_other_files(like, tmp, skip=weight_files | set(extra_files or {}))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return dst
