"""Dense DeepSeek-V3 checkpoints (the family ``attnlab.families.deepseek``) <-> ``attnlab.model.Transformer`` (MLA):
what ``attnlab convert --to mla`` writes. Loading and saving go through the family registry
(``attnlab.hf.causal_lm``); these are the MLA-specific entry points."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..config import MLAConfig, ModelConfig
from ..families.base import Fields
from ..families.deepseek import ARCHITECTURE, DEEPSEEK_V3, HALF_SPLIT, INTERLEAVED
from ..model import Transformer
from . import causal_lm, io

__all__ = [
    "ARCHITECTURE",
    "hf_config_from_model",
    "load_deepseek",
    "model_config_from_deepseek",
    "save_deepseek",
]


def model_config_from_deepseek(hf: dict) -> ModelConfig:
    """The ``ModelConfig`` of a dense DeepSeek-V3 config.json (a dict), after the checks an exact load needs."""
    if hf.get("model_type") != "deepseek_v3":
        raise ValueError(f"model_type must be 'deepseek_v3', got {hf.get('model_type')!r}")
    fields = Fields(hf, "deepseek_v3")
    return DEEPSEEK_V3.config(fields, loading=True)  # check_load refuses MoE layers by their field


def hf_config_from_model(cfg: ModelConfig, base: dict | None = None, rope_interleave: bool = True) -> dict:
    """A dense DeepSeek-V3 config.json dict for ``cfg`` (MLA attention with its latent norm), carrying the token ids
    and dtype of ``base`` (e.g. the Llama source's)."""
    base = dict(base or {})
    hf = DEEPSEEK_V3.write(cfg, base | {"model_type": "deepseek_v3", "rope_interleave": rope_interleave})
    return hf


def permute_rotary_rows(name: str, value: torch.Tensor, attn: MLAConfig, to_half_split: bool) -> torch.Tensor:
    """The RoPE layout transform of one attnlab tensor: its rotary rows reordered between DeepSeek's interleaved pairs
    and attnlab's half-split pairs (other tensors are returned unchanged)."""
    cfg = ModelConfig(vocab_size=1, n_layers=1, attention=attn, ffn_dim=1)
    key = re.sub(r"^layers\.(\d+)\.attention\.(wq|wq_b|wkv_a)\.(weight|bias)$", r"\2.\3", name)
    theirs = {"wq.weight": "q_proj.weight", "wq_b.weight": "q_b_proj.weight", "wkv_a.weight": "kv_a_proj_with_mqa.weight",
              "wkv_a.bias": "kv_a_proj_with_mqa.bias"}.get(key)  # fmt: skip
    if theirs is None:
        return value
    for rule in INTERLEAVED.rules:
        if rule.theirs.endswith(theirs) and rule.transform is not None:
            if to_half_split:
                return rule.transform.split(value, cfg)[0]
            return rule.transform.merge([value], cfg)
    return value


def load_deepseek(src: str | Path) -> Transformer:
    """An attnlab ``Transformer`` (MLA) holding a dense DeepSeek-V3 checkpoint (weights keep their dtype)."""
    hf = io.read_config(src)
    model_config_from_deepseek(hf)  # the dense-only checks, with their messages
    return causal_lm.load_causal_lm(src)


def state_to_hf(model: Transformer, rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 tensors of an attnlab MLA model (``lm_head`` omitted when embeddings are tied)."""
    return (INTERLEAVED if rope_interleave else HALF_SPLIT).to_checkpoint(model.state_dict(), model.cfg)


def save_deepseek(
    model: Transformer,
    dst: str | Path,
    *,
    base_config: dict | None = None,
    rope_interleave: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write an MLA ``model`` (with its latent norm) as a dense DeepSeek-V3 checkpoint directory, atomically;
    returns ``dst``. ``base_config``: the source's config.json, whose token ids and dtype are kept."""
    hf = hf_config_from_model(model.cfg, base_config, rope_interleave)
    return io.write_checkpoint(dst, state_to_hf(model, rope_interleave), hf, overwrite)
