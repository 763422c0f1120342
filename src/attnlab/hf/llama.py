"""Llama, Mistral and Qwen2 checkpoints (the family ``attnlab.families.llama``) <-> ``attnlab.model.Transformer``.

Loading and saving go through the family registry (``attnlab.hf.causal_lm``); this module adds the one layout
the registry does not know from config.json: Meta's original checkpoints pair RoPE dims (2i, 2i + 1) where Hugging
Face's pair (i, i + head_dim/2); ``layout="interleaved"`` permutes the rows of each ``wq``/``wk`` head with
``interleaved_to_half_split`` on import and back on export.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..attention.rope import interleaved_to_half_split
from ..config import ModelConfig
from ..families import family
from ..families.base import Fields
from ..families.llama import ARCHITECTURES, TENSORS
from ..families.llama import write as write_config
from ..model import Transformer
from . import causal_lm, io

LAYOUTS = ("half_split", "interleaved")


def model_config_from_hf(hf: dict) -> ModelConfig:
    """The ``ModelConfig`` of a Llama / Mistral / Qwen2 config.json (a dict)."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join([*ARCHITECTURES, 'bert'])}"
        )
    return family(model_type).config(Fields(hf, model_type))


def hf_config_from_model(cfg: ModelConfig, model_type: str = "llama", base: dict | None = None) -> dict:
    """A config.json dict for ``cfg``: ``base`` (e.g. the source's) with the fields that differ set."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type must be one of {', '.join(ARCHITECTURES)}; got {model_type!r}")
    return write_config(cfg, dict(base or {}) | {"model_type": model_type})


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")


def _permute_rope_rows(
    state: dict[str, torch.Tensor], cfg: ModelConfig, inverse: bool
) -> dict[str, torch.Tensor]:
    """The rows of every wq/wk head (and bias) permuted between interleaved and half-split RoPE pairs."""
    out = dict(state)
    for name, w in state.items():
        if re.search(r"attention\.w[qk]\.", name):
            perm = interleaved_to_half_split(cfg.attention.head_dim)
            perm = torch.argsort(perm) if inverse else perm
            head_dim = cfg.attention.head_dim
            out[name] = w.reshape(-1, head_dim, *w.shape[1:])[:, perm].reshape(w.shape)
    return out


def state_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig, layout: str = "half_split") -> dict:
    """attnlab state dict from Hugging Face tensors (the loaders check its key set against the model)."""
    _check_layout(layout)
    state = TENSORS.to_attnlab(tensors, cfg)
    return _permute_rope_rows(state, cfg, inverse=False) if layout == "interleaved" else state


def state_dict_to_hf(
    state: dict[str, torch.Tensor], cfg: ModelConfig, layout: str = "half_split"
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors of an attnlab state dict (e.g. gathered from a sharded model) of config ``cfg``."""
    _check_layout(layout)
    if layout == "interleaved":
        state = _permute_rope_rows(state, cfg, inverse=True)
    return TENSORS.to_checkpoint(state, cfg)


def state_to_hf(model: Transformer, layout: str = "half_split") -> dict[str, torch.Tensor]:
    """Hugging Face tensors of an attnlab model (``lm_head`` omitted when embeddings are tied)."""
    return state_dict_to_hf(model.state_dict(), model.cfg, layout)


def load_llama(src: str | Path, layout: str = "half_split") -> Transformer:
    """An attnlab ``Transformer`` holding a Llama / Mistral / Qwen2 checkpoint (weights keep their dtype)."""
    _check_layout(layout)
    hf = io.read_config(src)
    cfg = model_config_from_hf(hf)
    tensors, _ = io.read_tensors(src)
    theirs = family(hf["model_type"]).tensor_map(hf).theirs
    model = causal_lm.model_from_state(src, cfg, state_from_hf(tensors, cfg, layout), theirs)
    io.check_finite(model, src, theirs)
    return model


def save_llama(
    model: Transformer,
    dst: str | Path,
    model_type: str = "llama",
    *,
    base_config: dict | None = None,
    layout: str = "half_split",
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory (atomically); returns ``dst``."""
    hf = hf_config_from_model(model.cfg, model_type, base_config)
    return io.write_checkpoint(dst, state_to_hf(model, layout), hf, overwrite)
