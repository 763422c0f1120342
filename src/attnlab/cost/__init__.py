"""The cost model: what MHA, MQA, GQA and MLA cost for a model, as pure functions of the configs.

``attention_flops`` / ``model_flops`` (FLOPs), ``param_count`` / ``model_param_count`` (weights),
``kv_cache_bytes`` / ``decode_step_bytes`` (memory), ``roofline`` (time and fit on a ``Hardware``),
``get_preset`` / ``from_hf_config`` (models), ``variants`` / ``compare`` (the sweep ``attnlab compare`` prints)
and ``count_flops`` (measured FLOPs, attention included).
"""

from .counter import count_flops
from .flops import AttentionFlops, ModelFlops, attention_flops, model_flops
from .hardware import Hardware, get_hardware, measure_local
from .hf_config import from_hf_config
from .memory import decode_step_bytes, dtype_bits, kv_cache_bytes, kv_elements_per_token, weight_bytes_read
from .params import model_param_count, param_count
from .presets import get_preset, load_model, preset_names
from .roofline import PhaseCost, Roofline, roofline, weight_bytes
from .sweep import CompareRow, Comparison, Variant, compare, variants

__all__ = [
    "AttentionFlops",
    "CompareRow",
    "Comparison",
    "Hardware",
    "ModelFlops",
    "PhaseCost",
    "Roofline",
    "Variant",
    "attention_flops",
    "compare",
    "count_flops",
    "decode_step_bytes",
    "dtype_bits",
    "from_hf_config",
    "get_hardware",
    "get_preset",
    "kv_cache_bytes",
    "kv_elements_per_token",
    "load_model",
    "measure_local",
    "model_flops",
    "model_param_count",
    "param_count",
    "preset_names",
    "roofline",
    "variants",
    "weight_bytes",
    "weight_bytes_read",
]
