"""Hugging Face ``config.json`` <-> ``ModelConfig``: the one entry point to the readers and writers, which live in
the model families (``attnlab.families``: one module per family behind one registry).

``from_hf_config`` reads a config of any registered family (for the cost model, the checkpoint loaders and the
benchmark baselines); ``to_hf_config`` writes one through the family's writer. A required field that is missing,
of the wrong type, inconsistent with the others, or one attnlab does not model raises ``ValueError`` naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .config import AttentionConfig, MLAConfig, ModelConfig
from .families import family
from .families.base import MAX_FIELD, Fields, attention_fields, rope_parameters

__all__ = ["MAX_FIELD", "attention_to_hf", "from_hf_config", "read_raw", "rope_parameters", "to_hf_config"]


def read_raw(path_or_dict: str | Path | dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(the config.json dict, a default name) of a path to it, to its directory, or the parsed dict."""
    if isinstance(path_or_dict, dict):
        return path_or_dict, ""
    if not isinstance(path_or_dict, (str, Path)):
        raise TypeError(f"path_or_dict must be a path or a dict, got {type(path_or_dict).__name__}")
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    # atomic.read_json's rule, which this layer may not import: a nesting past the recursion limit or an int of
    # 5,000 digits is named with the file too
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:
        raise ValueError(f"{path} is not valid JSON: {type(err).__name__}: {str(err)[:200]}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw, path.parent.name


def _config_path(path_or_dict: str | Path | dict[str, Any]) -> str | None:
    """The config.json file ``read_raw`` read, for the errors to name (None for a dict)."""
    if isinstance(path_or_dict, dict):
        return None
    path = Path(path_or_dict)
    return str(path / "config.json" if path.is_dir() else path)


def quantization(raw: dict[str, Any]) -> str | None:
    """A config.json's quantization method (its ``quantization_config``'s ``quant_method``, "?" when unnamed), or
    None for an unquantized checkpoint: its tensors are then the weights themselves."""
    q = raw.get("quantization_config")
    if q is None:
        return None
    return str(q.get("quant_method", "?")) if isinstance(q, dict) else repr(q)


def from_hf_config(path_or_dict: str | Path | dict[str, Any], *, name: str | None = None) -> ModelConfig:
    """Read a ``config.json`` (a path to it, to its directory, or the parsed dict) into a ``ModelConfig``."""
    raw, default_name = read_raw(path_or_dict)
    model_type = raw.get("model_type")
    where = _config_path(path_or_dict)
    fam = family(model_type, where or "config.json")
    cfg = fam.config(Fields(raw, str(model_type), where))
    # the folder's name unless a non-empty string is given (a list or a number reached compare's title)
    given = raw.get("_name_or_path")
    if name is None:
        name = given if isinstance(given, str) and given else default_name
    return cfg.replace(name=name)


def to_hf_config(
    cfg: ModelConfig, model_type: str | None = None, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The config.json of ``cfg`` as a checkpoint of ``model_type`` (default: llama for GQA/MHA/MQA, deepseek_v3
    for MLA), built from ``base`` (e.g. the source's) by the family's writer."""
    if model_type is None:
        model_type = "deepseek_v3" if isinstance(cfg.attention, MLAConfig) else "llama"
    writer = family(model_type).write
    if writer is None:
        raise ValueError(f"attnlab reads {model_type} configs but does not write them")
    return writer(cfg, dict(base or {}) | {"model_type": model_type})


def attention_to_hf(attn: AttentionConfig | MLAConfig) -> dict[str, Any]:
    """The config.json fields of ``attn`` alone (Llama's names for GQA/MHA/MQA, DeepSeek-V3's for MLA), as the
    benchmark baselines build transformers' attention modules from them."""
    if isinstance(attn, AttentionConfig):
        return attention_fields(attn) | {
            "rope_parameters": {"rope_type": "default", "rope_theta": attn.rope_theta}
        }
    if not isinstance(attn, MLAConfig):
        raise TypeError(f"attn must be an AttentionConfig or MLAConfig, got {type(attn).__name__}")
    return dict(
        hidden_size=attn.d_model,
        num_attention_heads=attn.n_heads,
        rope_parameters={"rope_type": "default", "rope_theta": attn.rope_theta},
        num_key_value_heads=attn.n_heads,  # transformers repeats MLA's per-head keys by this ratio: 1
        q_lora_rank=attn.q_lora_rank or None,
        kv_lora_rank=attn.kv_lora_rank,
        qk_nope_head_dim=attn.qk_nope_head_dim,
        qk_rope_head_dim=attn.qk_rope_head_dim,
        v_head_dim=attn.v_head_dim,
        attention_bias=attn.bias,
    )
