"""Whole-model conversion and the calibration it needs.

A model here is anything with ``layers[i].attention`` (a ``GroupedQueryAttention``) and a ``cfg`` offering
``with_attention``: ``attnlab.model.Transformer`` and ``attnlab.hf.bert.BertEncoder``. A calibration batch is
either token ids (B, T), run as ``model(ids)`` with every position used, or a pair ``(ids, mask)`` with mask
(B, T) 1 = token whose padded positions are left out. An encoder with ``takes_padding_mask = True`` (BertEncoder)
runs as ``model(ids, mask)``; any other model runs as ``model(ids)``, which is right for causal decoders when the
padding is on the right (a token never attends to the pads after it).

Calibration runs in one pass (``calibrate``): every batch goes through the model's own forward up to
``layers[0]`` (a hook stops it there and keeps the layer's arguments: hidden states and the masks the model
built), then layer by layer: the layer's attention inputs are read off the stored hidden states (running the
layer only as far as its attention), the caller converts that attention, and the whole layer runs once on the
stored states to give the next layer's. So a conversion costs one forward pass over the calibration batches
(less the output head) plus the per-layer solves, where rerunning the model for each layer cost L passes.
This needs ``layers[i + 1]`` to receive ``layers[i]``'s output with the same other arguments for every layer,
as in both models above. Memory: the hidden states of every batch, ``sum_b B_b T_b d_model`` values in the
model's dtype (256 lines x 128 tokens at d_model 576 in float32: 75 MB), plus one batch's activations.

Which inputs a layer is calibrated on (``carry``):
    "converted" (the default) those it receives from the already converted layers below it (as GPTQ does for
                quantisation), so a layer's fit also absorbs the error of the earlier ones. The same weights
                as rerunning the partly converted model for each layer (``attention_inputs``).
    "source"    those the unconverted source model gives it: every layer is converted independently, the same
                as calibrating each layer on ``attention_inputs(source, i, batches)``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..attention.gqa import GroupedQueryAttention
from .gqa import mha_to_gqa

DATA_AWARE = ("fit", "grouped-fit")
CARRY = ("converted", "source")

Batch = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
Progress = Callable[[int, int], None]  # (layers done, layers in all)


class _Stop(Exception):
    """Raised by a forward pre-hook to end a forward pass once the arguments it wanted are captured."""

    def __init__(self, args: tuple, kwargs: dict | None = None) -> None:
        super().__init__()
        self.inputs, self.kwargs = args, kwargs or {}


def _stop(_module: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
    raise _Stop(args, kwargs)


def _run_model(model: nn.Module, batch: Batch) -> None:
    """Run ``model`` on one calibration batch, as the module docstring says."""
    if isinstance(batch, tuple):
        ids, mask = batch
        model(ids, mask) if getattr(model, "takes_padding_mask", False) else model(ids)
    else:
        model(batch)


def _real_tokens(batch: Batch) -> torch.Tensor:
    """(B, T) bool, True = a token (not padding)."""
    return batch[1].bool() if isinstance(batch, tuple) else torch.ones_like(batch, dtype=torch.bool)


@torch.no_grad()
def attention_inputs(model: nn.Module, index: int, batches: Sequence[Batch]) -> torch.Tensor:
    """Rows (N, d_model) that ``model.layers[index].attention`` receives at the non-padded positions.

    One whole-model pass per call: the per-layer recomputation that ``calibrate`` replaces, kept as its oracle.
    """
    seen: list[torch.Tensor] = []

    def hook(_module: nn.Module, args: tuple) -> None:
        seen.append(args[0].detach())  # (B, T, d_model)

    rows = []
    handle = model.layers[index].attention.register_forward_pre_hook(hook)
    try:
        for batch in batches:
            seen.clear()
            _run_model(model, batch)
            rows.append(seen[-1][_real_tokens(batch)])
    finally:
        handle.remove()
    if not rows or not sum(len(r) for r in rows):
        raise ValueError("calibration produced no activations: give at least one non-empty batch")
    return torch.cat(rows)


@dataclass
class _State:
    hidden: torch.Tensor  # (B, T, d_model): the input of the current layer
    args: tuple  # the layer's other positional arguments (BertEncoder: the key padding mask)
    kwargs: dict  # and keyword arguments (Transformer: attn_mask, cache)
    mask: torch.Tensor  # (B, T) bool, True = real token


def _first_layer_inputs(model: nn.Module, batches: Sequence[Batch]) -> list[_State]:
    states = []
    handle = model.layers[0].register_forward_pre_hook(_stop, with_kwargs=True)
    try:
        for batch in batches:
            try:
                _run_model(model, batch)
            except _Stop as stop:
                states.append(_State(stop.inputs[0], stop.inputs[1:], stop.kwargs, _real_tokens(batch)))
            else:
                raise TypeError(f"{type(model).__name__}.forward never called layers[0]")
    finally:
        handle.remove()
    if not sum(int(s.mask.sum()) for s in states):
        raise ValueError("calibration produced no activations: give at least one non-empty batch")
    return states


class LayerInputs:
    """What one layer's attention receives on every calibration batch: iterating gives ``(x, mask)`` pairs,
    x (B, T, d_model) and mask (B, T) bool (True = real token), recomputed from the stored hidden states on
    each iteration by running the layer as far as its attention. Valid until ``calibrate`` moves on."""

    def __init__(self, layer: nn.Module, states: list[_State]) -> None:
        self._layer, self._states = layer, states

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for state in self._states:
            yield self._attention_input(state), state.mask

    def _attention_input(self, state: _State) -> torch.Tensor:
        handle = self._layer.attention.register_forward_pre_hook(_stop)
        try:
            self._layer(state.hidden, *state.args, **state.kwargs)
        except _Stop as stop:
            return stop.inputs[0]
        finally:
            handle.remove()  # before the caller runs anything: it may call this very attention
        raise TypeError(f"{type(self._layer).__name__}.forward never called its attention")

    def rows(self) -> Iterator[torch.Tensor]:
        """The inputs (n, d_model) at the real tokens, batch by batch."""
        for x, mask in self:
            yield x[mask]


def check_batches(batches: object, name: str, model: nn.Module | None = None) -> None:
    """``batches`` must be a non-empty list of token batches: integer tensors (B, T), or ``(ids, mask)`` pairs of
    one shape; given ``model``, ids of its vocabulary. A ValueError or TypeError naming ``name`` otherwise (a bare
    tensor once raised 'Boolean value of Tensor ... is ambiguous', an id past the vocabulary an IndexError)."""
    what = f"{name} must be a non-empty list of token batches (B, T) or (ids, mask) pairs"
    if isinstance(batches, torch.Tensor):
        raise TypeError(f"{what}, got a tensor: pass [{name}]")
    if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence) or not batches:
        raise ValueError(f"{what}, got {type(batches).__name__} {batches!r:.60}")
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    for i, batch in enumerate(batches):
        ids, mask = batch if isinstance(batch, tuple) and len(batch) == 2 else (batch, None)
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(
                f"{name}[{i}] must hold integer token ids, got {getattr(ids, 'dtype', type(ids))}"
            )
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != ids.shape):
            raise ValueError(f"{name}[{i}]: the mask must be a tensor of the ids' shape {tuple(ids.shape)}")
        if vocab is not None and ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < vocab):
            raise ValueError(f"{name}[{i}] holds token ids outside the model's vocabulary [0, {vocab})")


@torch.no_grad()
def calibrate(
    model: nn.Module, batches: Sequence[Batch], *, carry: str = "converted"
) -> Iterator[LayerInputs]:
    """For each of ``model.layers`` in order, the ``LayerInputs`` of its attention, in one pass over the
    batches (module docstring). Before taking the next, the caller may replace ``model.layers[i].attention``;
    ``carry`` says which attention then gives the next layer its inputs: "converted" the one in place,
    "source" the one that was in place when the layer's inputs were given."""
    if carry not in CARRY:
        raise ValueError(f"carry must be one of {', '.join(CARRY)}; got {carry!r}")
    check_batches(batches, "calib", model)
    states = _first_layer_inputs(model, batches)
    last = len(model.layers) - 1
    for i, layer in enumerate(model.layers):
        source = layer.attention
        yield LayerInputs(layer, states)
        if i == last:
            break
        converted = layer.attention
        layer.attention = source if carry == "source" else converted
        try:
            for state in states:  # in place: one copy of the hidden states at a time
                state.hidden = layer(state.hidden, *state.args, **state.kwargs)
        finally:
            layer.attention = converted


@torch.no_grad()
def convert_model(
    model: nn.Module,
    n_kv_heads: int,
    method: str = "mean",
    *,
    calib: Sequence[Batch] | None = None,
    seed: int = 0,
    carry: str = "converted",
    progress: Progress | None = None,
    share: bool = False,
) -> nn.Module:
    """A converted copy of ``model`` with ``n_kv_heads`` KV heads in every layer; ``model`` is not modified.

    ``carry``: which inputs "fit" and "grouped-fit" calibrate each layer on (module docstring).
    ``progress(done, total)`` is called after each layer. ``share``: the copy's tensors outside the attention
    modules it replaces are ``model``'s own (not a second copy of the weights in memory): for a caller that
    neither trains nor edits the copy in place, as ``attnlab convert`` (which writes it and lets it go).
    """
    if method in DATA_AWARE and calib is None:
        raise ValueError(f"method={method!r} needs calib: a non-empty list of token batches (B, T)")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if not isinstance(model, nn.Module) or not hasattr(model, "layers"):
        raise TypeError(f"model must be an attnlab Transformer or BertEncoder, got {type(model).__name__}")
    if method in DATA_AWARE:
        check_batches(calib, "calib", model)
    if carry not in CARRY:
        raise ValueError(f"carry must be one of {', '.join(CARRY)}; got {carry!r}")
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())} if share else {}
    out = copy.deepcopy(model, memo).eval()
    for i, layer in enumerate(out.layers):
        if not isinstance(layer.attention, GroupedQueryAttention):
            raise TypeError(f"layers.{i}.attention is a {type(layer.attention).__name__}, not GQA")
    merges = any(layer.attention.n_kv_heads != n_kv_heads for layer in out.layers)
    n = len(out.layers)
    steps = calibrate(out, calib, carry=carry) if method in DATA_AWARE and merges else [None] * n
    for i, inputs in enumerate(steps):
        layer = out.layers[i]
        x = inputs.rows() if inputs is not None else None  # streamed: only their second moment is kept
        layer.attention = mha_to_gqa(layer.attention, n_kv_heads, method, calib=x, seed=seed + i)
        if progress is not None:
            progress(i + 1, n)
    if hasattr(out.cfg, "map_attention"):  # every kind of layer (full, sliding) gets the new KV heads
        out.cfg = out.cfg.map_attention(lambda attn: attn.replace(n_kv_heads=n_kv_heads))
    elif n:
        out.cfg = out.cfg.with_attention(out.layers[0].attention.cfg)
    return out
