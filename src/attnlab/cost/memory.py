"""Bytes: KV cache, weights, and what one decode step reads.

KV cache per token (DESIGN.md): ``2 * n_layers * n_kv_heads * head_dim * bytes`` for MHA/MQA/GQA (a key and a
value per KV head), ``n_layers * (kv_lora_rank + qk_rope_head_dim) * bytes`` for MLA (the latent and the one
rotary key shared by all heads). Sizes below a byte per element (fp6, int4) are counted in bits and rounded up
to whole bytes once, for the whole cache.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import AttentionConfig, MLAConfig, ModelConfig, check_int
from .params import mlp_param_count, model_param_count

# Bits per element. fp6 is DeepSeek-V2's "~6 bits per element" KV quantisation (arXiv 2405.04434, Sec. 3.2.3).
DTYPE_BITS: dict[str, int] = {
    "fp64": 64,
    "fp32": 32,
    "tf32": 32,
    "bf16": 16,
    "fp16": 16,
    "fp8": 8,
    "int8": 8,
    "fp6": 6,
    "int4": 4,
    "fp4": 4,
}
_ALIASES = {
    "float64": "fp64",
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
}


# The names that PyTorch computes in (fp8 is a storage size here, int4 and fp6 only sizes for the cost model).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def dtype_name(dtype: str | torch.dtype) -> str:
    """The canonical short name ("bf16", "fp8", ...) of a dtype string or torch.dtype."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a string or torch.dtype, got {dtype!r} ({type(dtype).__name__})")
    name = _ALIASES.get(dtype.lower(), dtype.lower())
    if name.startswith(("float8_", "float4_")):  # torch's other fp8 / fp4 formats (e4m3fnuz, e8m0fnu, ...)
        name = "fp8" if name.startswith("float8_") else "fp4"
    if name not in DTYPE_BITS:
        known = ", ".join(DTYPE_BITS)
        raise ValueError(f"dtype {dtype!r} is not known; use one of {known} or a torch.dtype")
    return name


# Weights stored in these are dequantised to be computed: the activations (and what tensor parallelism sends) are bf16.
STORAGE_ONLY = ("int8", "fp6", "int4", "fp4")


def activation_dtype(dtype: str | torch.dtype, hw: Any = None) -> str:
    """The dtype a model whose weights are stored in ``dtype`` computes its activations in: bf16 for weights stored
    narrower than any arithmetic (int8, fp6, int4, fp4), and on a device ``hw`` (a ``Hardware``) that has no rate of
    its own for ``dtype`` (fp8 on an A100), as ``roofline.compute_peak`` computes it there."""
    name = dtype_name(dtype)
    if name in STORAGE_ONLY or (
        hw is not None and name not in ("fp32", "fp64") and name not in hw.peak_flops
    ):
        return "bf16"
    return name


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch.dtype of a dtype name ("bf16", "float32", ...) that PyTorch computes in."""
    name = dtype_name(dtype)
    if name not in TORCH_DTYPES:
        raise ValueError(
            f"dtype {name!r} is a storage size only; compute in one of {', '.join(TORCH_DTYPES)}"
        )
    return TORCH_DTYPES[name]


def dtype_bits(dtype: str | torch.dtype) -> int:
    """Bits per element; any torch.dtype (int32, float8_e5m2fnuz, ...) counts by its itemsize."""
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize * 8
    return DTYPE_BITS[dtype_name(dtype)]


def _bits_to_bytes(bits: int) -> int:
    return -(-bits // 8)


def kv_elements_per_token(cfg: AttentionConfig | MLAConfig | ModelConfig) -> int:
    """Values cached per token: one layer for an attention config, all layers for a ModelConfig (a sliding-window
    layer caches a token only while it is within its window: ``kv_cache_bytes`` counts that)."""
    if isinstance(cfg, ModelConfig):
        return sum(kv_elements_per_token(attn) for attn in cfg.layer_attentions)
    if isinstance(cfg, AttentionConfig):
        return 2 * cfg.n_kv_heads * cfg.head_dim
    if isinstance(cfg, MLAConfig):
        return cfg.cache_dim
    raise TypeError(f"cfg must be a ModelConfig, AttentionConfig or MLAConfig, got {type(cfg).__name__}")


def cached_tokens(cfg: AttentionConfig | MLAConfig, seq_len: int) -> int:
    """Tokens a layer's cache holds for ``seq_len`` tokens: all of them, or at most its sliding window."""
    window = getattr(cfg, "window", None)
    return seq_len if window is None else min(window, seq_len)


def kv_cache_bytes(
    cfg: AttentionConfig | MLAConfig | ModelConfig,
    batch: int,
    seq_len: int,
    dtype: str | torch.dtype = "bf16",
) -> int:
    """Bytes of the KV cache for ``batch`` sequences of ``seq_len`` tokens (all layers of a ModelConfig; a
    sliding-window layer holds ``min(window, seq_len)`` tokens).

    Equals ``cache.nbytes`` of the caches attnlab builds (``KVCache``, ``LatentCache``) with that ``max_seq_len``.
    """
    check_int("batch", batch)
    check_int("seq_len", seq_len)
    layers = cfg.layer_attentions if isinstance(cfg, ModelConfig) else (cfg,)
    elements = sum(kv_elements_per_token(attn) * cached_tokens(attn, seq_len) for attn in layers)
    return _bits_to_bytes(elements * batch * dtype_bits(dtype))


def expected_experts_touched(model_cfg: ModelConfig, batch: int) -> float:
    """Routed experts one decode step reads, per MoE layer, for ``batch`` tokens.

    Assumes uniform, independent routing: an expert is missed by one token with probability
    ``1 - k / n`` (k = n_active_experts of n = n_experts), so ``n * (1 - (1 - k/n) ** batch)`` are touched.
    Batch 1 reads exactly k experts; a large batch reads them all.
    """
    n, k = model_cfg.n_experts, model_cfg.n_active_experts
    return n * (1.0 - (1.0 - k / n) ** batch)


def weight_bytes_read(model_cfg: ModelConfig, batch: int = 1, dtype: str | torch.dtype = "bf16") -> int:
    """Weight bytes one decode step of ``batch`` tokens reads.

    Every weight matrix is read once per step; the embedding tables are only gathered (``batch`` rows), unless
    the token table is tied to the LM head, which reads all of it. An MoE layer reads its router, its shared
    experts and the routed experts the batch touches (``expected_experts_touched``).
    """
    check_int("batch", batch)
    n = model_param_count(model_cfg, active=True)  # all of it but untouched experts and embedding tables
    n += batch * model_cfg.d_model  # the gathered embedding rows
    if model_cfg.is_moe:
        n_moe = model_cfg.n_layers - model_cfg.n_dense_layers
        one_expert = mlp_param_count(
            model_cfg.d_model, model_cfg.moe_ffn_dim, model_cfg.mlp, model_cfg.mlp_bias
        )
        extra = expected_experts_touched(model_cfg, batch) - model_cfg.n_active_experts
        n += round(n_moe * extra * one_expert)
    return _bits_to_bytes(n * dtype_bits(dtype))


def decode_step_bytes(
    model_cfg: ModelConfig,
    batch: int,
    kv_len: int,
    dtype: str | torch.dtype = "bf16",
    kv_dtype: str | torch.dtype | None = None,
) -> int:
    """Bytes one decode step reads from memory: the weights (``weight_bytes_read``) and the KV cache of
    ``kv_len`` tokens per sequence. Activations are ignored (a few rows of d_model per token)."""
    check_int("kv_len", kv_len)
    kv = kv_cache_bytes(model_cfg, batch, kv_len, kv_dtype if kv_dtype is not None else dtype)
    return weight_bytes_read(model_cfg, batch, dtype) + kv


def activation_bytes(model_cfg: ModelConfig, batch: int, seq_len: int, *, training: bool) -> int:
    """A lower bound of the float32 activations of one forward pass over ``batch`` x ``seq_len`` tokens.

    Counted: the logits, (B, T, vocab), which dominate small models with large vocabularies, and the log-softmax
    the loss takes of them (counted once, an evaluation of a 49,152-token vocabulary peaked at twice the estimate),
    in training both their gradients; per layer, what autograd must keep for the backward pass at the least: the
    block's input and the attention output (d_model each), the query, key and value rows, and the MLP's hidden
    activations (two of ffn_dim for a gated MLP). A forward without gradients keeps one layer's worth at a time.
    Softmax scores are not counted (SDPA's fused kernels keep only their log-sum-exp), so the true figure is
    higher, never lower.
    """
    check_int("batch", batch)
    check_int("seq_len", seq_len)
    attn = model_cfg.attention
    if isinstance(attn, MLAConfig):
        qkv = attn.n_heads * (attn.qk_head_dim * 2 + attn.v_head_dim)
    else:
        qkv = (attn.n_heads + 2 * attn.n_kv_heads) * attn.head_dim
    gated = 2 if model_cfg.mlp.endswith("glu") else 1  # SwiGLU, GeGLU: gate and up
    per_layer = 2 * model_cfg.d_model + qkv + gated * model_cfg.ffn_dim
    layers = model_cfg.n_layers if training else 1
    logits = (4 if training else 2) * model_cfg.vocab_size
    return 4 * batch * seq_len * (layers * per_layer + logits)


def training_step_bytes(
    model_cfg: ModelConfig, batch: int, seq_len: int, *, teacher: ModelConfig | None = None
) -> int:
    """A lower bound of the memory one uptraining step needs in float32 (``attnlab uptrain``): every parameter
    with its gradient and AdamW's two moments (16 bytes each), the activations of a micro-batch of ``batch``
    sequences (``activation_bytes``), and a distillation teacher's weights and forward pass."""
    n = 16 * model_param_count(model_cfg) + activation_bytes(model_cfg, batch, seq_len, training=True)
    if teacher is not None:
        n += 4 * model_param_count(teacher) + activation_bytes(teacher, batch, seq_len, training=False)
    return n
