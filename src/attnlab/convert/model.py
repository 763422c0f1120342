"""Whole-model conversion and the calibration it needs.

A model here is anything with ``layers[i].attention`` (a ``GroupedQueryAttention``) and a ``cfg`` offering
``with_attention``: ``attnlab.model.Transformer`` and ``attnlab.hf.bert.BertEncoder``. A calibration batch is
either token ids (B, T), run as ``model(ids)`` with every position used, or a pair ``(ids, mask)`` with mask
(B, T) 1 = token whose padded positions are left out. An encoder with ``takes_padding_mask = True`` (BertEncoder)
runs as ``model(ids, mask)``; any other model runs as ``model(ids)``, which is right for causal decoders when the
padding is on the right (a token never attends to the pads after it).

Layers are converted in order and each layer is calibrated on the inputs it receives from the already converted
layers below it (as GPTQ does for quantisation), so a layer's fit also absorbs the error of the earlier ones.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from ..attention.gqa import GroupedQueryAttention
from .gqa import mha_to_gqa

DATA_AWARE = ("fit", "grouped-fit")


Batch = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@torch.no_grad()
def attention_inputs(model: nn.Module, index: int, batches: Sequence[Batch]) -> torch.Tensor:
    """Rows (N, d_model) that ``model.layers[index].attention`` receives at the non-padded positions."""
    seen: list[torch.Tensor] = []

    def hook(_module: nn.Module, args: tuple) -> None:
        seen.append(args[0].detach())  # (B, T, d_model)

    rows = []
    handle = model.layers[index].attention.register_forward_pre_hook(hook)
    try:
        for batch in batches:
            seen.clear()
            if isinstance(batch, tuple):
                ids, mask = batch
                model(ids, mask) if getattr(model, "takes_padding_mask", False) else model(ids)
                rows.append(seen[-1][mask.bool()])
            else:
                model(batch)
                rows.append(seen[-1].reshape(-1, seen[-1].shape[-1]))
    finally:
        handle.remove()
    if not rows or not sum(len(r) for r in rows):
        raise ValueError("calibration produced no activations: give at least one non-empty batch")
    return torch.cat(rows)


@torch.no_grad()
def convert_model(
    model: nn.Module,
    n_kv_heads: int,
    method: str = "mean",
    *,
    calib: Sequence[Batch] | None = None,
    seed: int = 0,
) -> nn.Module:
    """A converted copy of ``model`` with ``n_kv_heads`` KV heads in every layer; ``model`` is not modified."""
    if method in DATA_AWARE and not calib:
        raise ValueError(f"method={method!r} needs calib: a non-empty list of token batches (B, T)")
    out = copy.deepcopy(model).eval()
    new_cfg = None
    for i, layer in enumerate(out.layers):
        if not isinstance(layer.attention, GroupedQueryAttention):
            raise TypeError(f"layers.{i}.attention is a {type(layer.attention).__name__}, not GQA")
        merges = layer.attention.n_kv_heads != n_kv_heads
        x = attention_inputs(out, i, calib) if method in DATA_AWARE and merges else None
        layer.attention = mha_to_gqa(layer.attention, n_kv_heads, method, calib=x, seed=seed + i)
        new_cfg = layer.attention.cfg
    if new_cfg is not None:
        out.cfg = out.cfg.with_attention(new_cfg)
    return out
