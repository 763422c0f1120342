"""Measured FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` plus the attention kernels it misses.

FlopCounterMode counts matmuls (``mm``, ``addmm``, ``bmm``, ...; einsum and ``@`` reach those) and the CUDA
SDPA kernels, but it has no formula for the CPU fused kernel ``aten._scaled_dot_product_flash_attention_for_cpu``
or its backward, so ``F.scaled_dot_product_attention`` on CPU counts 0 FLOPs. ``count_flops`` adds formulas
for those, per query head (a GQA call, ``enable_gqa=True``, passes K/V with fewer heads: each query head
still scores against all keys), and for ``aten._grouped_mm``, the grouped GEMM of mixture-of-experts layers
(Hugging Face's DeepSeek experts run on it), which FlopCounterMode does not count either. attnlab's own kernels
(``torch.ops.attnlab.decode``, ``linear``, ``block_step``, ...) carry their formulas themselves (registered by
``attention/fused.py`` when attnlab is imported), so a plain FlopCounterMode counts them too.

Backward is counted as the math of the gradients: ``dV = P^T dO``, ``dP = dO V^T``, ``dQ = dS K``,
``dK = dS^T Q``, twice the forward products, the same as the explicit matmuls of the "reference" backend.
PyTorch's own formulas for the CUDA kernels add the recomputation of ``Q K^T`` that a flash kernel does;
``count_flops`` replaces them so that every backend reports the same number for the same attention.

Shapes: q (B, H, T_q, D), k (B, H_kv, T_k, D), v (B, H_kv, T_k, D_v), grad_out (B, H, T_q, D_v).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

aten = torch.ops.aten


def _sdpa_forward(q_shape, k_shape, v_shape) -> int:
    b, h, t_q, d = q_shape
    t_k, d_v = k_shape[2], v_shape[3]
    return 2 * b * h * t_q * t_k * (d + d_v)  # scores q k^T, then p v


def _sdpa_forward_flops(query, key, value, *args: Any, out_shape=None, **kwargs: Any) -> int:
    return _sdpa_forward(query, key, value)


def _sdpa_backward_flops(grad_out, query, key, value, *args: Any, out_shape=None, **kwargs: Any) -> int:
    return 2 * _sdpa_forward(query, key, value)


def _grouped_mm_flops(a, b, *args: Any, out_shape=None, **kwargs: Any) -> int:
    """``aten._grouped_mm`` (mixture-of-experts layers, e.g. Hugging Face's DeepSeek experts): one product per
    group; only the total rows (or inner sizes) matter. (M, K) x (G, K, N): the M rows are split over G groups;
    (G, M, K) x (G, K, N): a batch; (M, K) x (K, N): K split over groups; (G, M, K) x (K, N): N split."""
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    return 2 * a[1] * a[2] * b[1]


def _ops(*names: str) -> list[Any]:
    """The aten ops of these names that this build of PyTorch has."""
    return [getattr(aten, n) for n in names if hasattr(aten, n)]


def _custom_mapping() -> dict[Any, Any]:
    forward = _ops(
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    backward = _ops(
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention_backward",
    )
    mapping: dict[Any, Any] = dict.fromkeys(forward, _sdpa_forward_flops)
    mapping.update(dict.fromkeys(backward, _sdpa_backward_flops))
    mapping.update(dict.fromkeys(_ops("_grouped_mm"), _grouped_mm_flops))
    return mapping


class count_flops:
    """Count the FLOPs of everything run inside ``with count_flops() as fc:``.

    ``fc.total`` is the sum; ``fc.by_op`` maps op names ("bmm", "_scaled_dot_product_flash_attention_for_cpu",
    ...) to their FLOPs. Same conventions as ``attnlab.cost.attention_flops`` (a multiply-add is 2 FLOPs).
    """

    def __init__(self) -> None:
        self._mode = FlopCounterMode(display=False, custom_mapping=_custom_mapping())

    def __enter__(self) -> count_flops:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    @property
    def total(self) -> int:
        return int(self._mode.get_total_flops())

    @property
    def by_op(self) -> dict[str, int]:
        counts = self._mode.get_flop_counts().get("Global", {})
        return {str(op).removeprefix("aten."): int(n) for op, n in counts.items()}
