"""Linear layers for decode steps: ``nn.Linear`` whose products of a few rows run the C++ matrix-vector kernel.

A decode step multiplies one token per sequence by every weight of the model, so it is bound by how fast the
weights stream from memory. BLAS matrix products are built for many rows; for one row, ``fused.linear`` reads
the weight at 1.4-2.1x their rate on this project's machines (benchmarks/linear.py). ``Linear`` takes that
path for inputs of at most ``fused.LINEAR_MAX_ROWS`` rows when ``fused.linear_supports`` them (CPU, float32 or
bfloat16, no gradient, the kernel built; a compiled step keeps the operator in its graph), ``nn.Linear``'s
otherwise, so training, prefill, tensor-parallel (DTensor) weights and other devices are unchanged. ``project``
applies several linear layers to one input in one pass (a layer's query, key and value projections; the MLP's gate
and up projections).

Results equal ``nn.Linear``'s to float32 rounding (the sums run in another order), and a row's result does not
depend on the other rows of the batch.
"""

from __future__ import annotations

import torch
from torch import nn

from . import fused


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) with the fused few-row path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.linear_supports(x, self.weight, self.bias):
            return fused.linear(x, [self.weight], [self.bias])
        return super().forward(x)


def _plain(layer: nn.Module) -> bool:
    """A layer whose forward is ``F.linear`` with nothing hooked on it."""
    return type(layer) in (Linear, nn.Linear) and not (layer._forward_hooks or layer._forward_pre_hooks)


def project(x: torch.Tensor, *layers: nn.Module) -> tuple[torch.Tensor, ...]:
    """``tuple(layer(x) for layer in layers)``, the weights read in one pass when the fused kernel takes them
    (the outputs are then views of one buffer)."""
    if all(_plain(layer) for layer in layers):
        params = [p for layer in layers for p in (layer.weight, layer.bias)]
        if fused.linear_supports(x, *params):
            y = fused.linear(x, [layer.weight for layer in layers], [layer.bias for layer in layers])
            return y.split([layer.weight.shape[0] for layer in layers], dim=-1)
    return tuple(layer(x) for layer in layers)
