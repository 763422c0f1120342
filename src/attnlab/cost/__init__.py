"""The cost model: what MHA, MQA, GQA and MLA cost for a model, as pure functions of the configs.

``attention_flops`` / ``model_flops`` (FLOPs), ``param_count`` / ``model_param_count`` (weights),
``kv_cache_bytes`` / ``decode_step_bytes`` (memory), ``roofline`` / ``step_seconds`` / ``compute_peak`` (time and
fit on a ``Hardware``), ``get_preset`` / ``from_hf_config`` (models), ``variants`` / ``compare`` (the sweep ``attnlab compare``
prints). Nothing here runs a model, times, prints or plots: measuring this machine (``measure_local``), counting
FLOPs of real modules (``count_flops``), tables, plots and timed layers are in ``attnlab.bench``.
"""

from ..hf_config import from_hf_config
from .flops import AttentionFlops, ModelFlops, attention_flops, model_flops
from .hardware import Hardware, get_hardware
from .memory import (
    decode_step_bytes,
    dtype_bits,
    dtype_name,
    kv_cache_bytes,
    kv_elements_per_token,
    torch_dtype,
    weight_bytes_read,
)
from .params import model_param_count, param_count
from .presets import get_preset, load_model, preset_names
from .roofline import PhaseCost, Roofline, compute_peak, roofline, step_seconds, weight_bytes
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
    "compute_peak",
    "decode_step_bytes",
    "dtype_bits",
    "dtype_name",
    "from_hf_config",
    "get_hardware",
    "get_preset",
    "kv_cache_bytes",
    "kv_elements_per_token",
    "load_model",
    "model_flops",
    "model_param_count",
    "param_count",
    "preset_names",
    "roofline",
    "step_seconds",
    "torch_dtype",
    "variants",
    "weight_bytes",
    "weight_bytes_read",
]
