"""Attention backends as objects that declare what they can take, one table of them, and the one choice made from it.

A ``Backend`` declares its capabilities: the device types and dtypes it runs on, the phases it computes
("prefill": several queries per row, "decode": one), and whether it takes paged K/V, a mask, dropout, a gradient to
record, logit soft-capping, tensor subclasses (DTensor), and whole decoder-block steps (and of how many rows); whether
it takes MLA's latent rows (one KV head whose values are the first columns of its keys), or only those; and
whether it can run here at all (the C++ kernels built). ``BACKENDS`` maps each name to its backend; the backends are
added where they are defined (``attention/kernels.py``), and ``AUTO`` orders them per (device type, phase) as
measured there.

``choose(call, backend)`` is the one place a backend is picked: ``attend`` asks it once per call, the model's block
plan once per decode step. A ``Call`` says what is asked (device, dtype, phase, paged, mask, dropout, gradient,
soft-capping, subclass, block step, latent rows, row lengths, values wider than the keys). "auto" takes the first backend of the order that accepts the call; a named
backend runs if it accepts it, else the call goes down the order as for "auto" (so "fused" on a masked step runs
"grouped", and on a paged prefill "sdpa"); a block step is not handed on: it runs on the backend named (with
"auto", the first of the order that takes it) or, when that has none, module by module. The ``Choice`` names the backend and, for every other backend, why it was
skipped: what it cannot take, or that it comes later in the order.

Seeing the choices: ``ATTNLAB_BACKENDS=1`` in the environment (or ``log_choices(True)``) prints each distinct choice
to stderr once, as it is first made; ``explain(call, backend)`` returns it as text.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..config import env_switch

PHASES = ("prefill", "decode")


class Call(NamedTuple):
    """What one call asks of a backend."""

    device: str  # device type: "cpu", "cuda", ...
    dtype: torch.dtype
    phase: str  # "prefill" (several queries per row) or "decode" (one)
    paged: bool = False  # K/V in a block pool (PagedViews)
    mask: bool = False  # an attention mask (the causal rule and windows are not masks here)
    dropout: bool = False
    grad: bool = False  # a gradient to record through the call
    softcap: bool = False  # logit soft-capping (Gemma 2)
    subclass: bool = False  # a tensor subclass (DTensor) among the operands
    block: int = 0  # a whole decoder block's decode step of this many rows (0: attention alone)
    latent: bool = False  # one KV head whose values are the first columns of its keys (MLA's latent rows)
    # each row's keys are the first of fixed buffers, their number per row in a tensor on the device (a static
    # cache's decode step): a backend that reads lengths takes them, one that takes masks gets them as a mask
    lengths: bool = False
    wide: bool = False  # values wider than the keys (D_v > D_k)
    counting: bool = False  # under torch's FlopCounterMode (``attnlab.bench.count_flops``)

    def __str__(self) -> str:
        what = f"{self.block}-row block step" if self.block else ("paged " if self.paged else "") + self.phase
        what = ("latent " if self.latent else "") + what
        extras = [
            n
            for n in ("mask", "lengths", "dropout", "grad", "softcap", "subclass", "wide", "counting")
            if getattr(self, n)
        ]
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.device} {dtype} {what}" + (f" with {', '.join(extras)}" if extras else "")


# Call flags a backend may refuse
_LIMITS = ("mask", "dropout", "grad", "softcap", "subclass", "wide", "counting")
_WORDS = {"mask": "masks", "dropout": "dropout", "grad": "gradients", "softcap": "soft-capping",
          "subclass": "tensor subclasses", "wide": "values wider than the keys",
          "counting": "FLOP counting (FlopCounterMode)"}  # fmt: skip


@dataclass(frozen=True)
class Backend:
    """One attention backend: ``run(q, k, v, attn_mask, is_causal, scale, dropout_p, window, softcap)`` with the
    shapes of ``attend`` (k and v may be PagedViews when ``paged``), and what it can take."""

    name: str
    run: Callable[..., torch.Tensor]
    devices: frozenset[str] | None = None  # device types; None: any
    dtypes: frozenset[torch.dtype] | None = None  # None: any
    phases: frozenset[str] = frozenset(PHASES)
    paged: bool = True  # reads PagedViews (in place or gathered)
    mask: bool = True
    dropout: bool = True
    grad: bool = True
    softcap: bool = True
    subclass: bool = True
    wide: bool = True  # values wider than the keys
    counting: bool = True  # runs under FlopCounterMode
    block_rows: int = 0  # whole decoder-block decode steps of up to this many rows; 0: none
    latent_only: bool = False  # takes only MLA's latent rows (``Call.latent``)
    latent: bool = True  # takes MLA's latent rows (values the first columns of the keys, narrower than them)
    # reads rows' lengths (``Call.lengths``) itself, through run(..., lengths=); else it gets them as a mask
    lengths: bool = False
    available: Callable[[], bool] | None = None  # None: always; else asked last (it may build a kernel)

    def refuses(self, call: Call) -> str | None:
        """Why this backend cannot take ``call``, or None when it can."""
        if self.devices is not None and call.device not in self.devices:
            return f"runs on {', '.join(sorted(self.devices))} only"
        if self.dtypes is not None and call.dtype not in self.dtypes:
            return f"takes {', '.join(sorted(str(d).removeprefix('torch.') for d in self.dtypes))} only"
        if call.phase not in self.phases:
            return f"computes {', '.join(sorted(self.phases))} only"
        if call.paged and not self.paged:
            return "reads no paged K/V"
        if self.latent_only and not call.latent:
            return "reads MLA latent rows only"
        if call.latent and not self.latent:
            return "reads no MLA latent rows"
        for flag in _LIMITS:
            if getattr(call, flag) and not getattr(self, flag):
                return f"takes no {_WORDS[flag]}"
        if call.lengths and not (self.lengths or self.mask):
            return "takes no row lengths or masks"
        if call.block > self.block_rows:
            return (
                "has no block step"
                if self.block_rows == 0
                else f"block steps of {self.block_rows} rows at most"
            )
        if self.available is not None and not self.available():
            return "not available here"
        return None


BACKENDS: dict[str, Backend] = {}  # name -> backend, filled where each is defined (kernels.py)

# (device type, phase) -> the backends "auto" tries, in order; device type "*": any device not listed. Filled in
# kernels.py with the measurements behind each row.
AUTO: dict[tuple[str, str], tuple[str, ...]] = {}


def register(backend: Backend) -> Backend:
    BACKENDS[backend.name] = backend
    return backend


class Choice(NamedTuple):
    """The backend chosen for a call (None when none takes it: a block step that no backend has) and why the others
    were not: (name, reason) for each."""

    backend: Backend | None
    call: Call
    asked: str  # "auto" or the backend the caller named
    skipped: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        ran = self.backend.name if self.backend is not None else "none (module by module)"
        head = f"{ran} for a {self.call} (asked: {self.asked})"
        return head + "".join(f"; {name}: {why}" for name, why in self.skipped)


def order(call: Call, backend: str = "auto") -> tuple[str, ...]:
    """The backends ``choose`` tries for ``call``, in order. A block step is the named backend's alone: a layer
    configured for "grouped" keeps its attention there rather than handing its block to another backend."""
    auto = AUTO.get((call.device, call.phase)) or AUTO[("*", call.phase)]
    if backend == "auto":
        return auto
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of auto, {', '.join(BACKENDS)}; got {backend!r}")
    if call.block:
        return (backend,)
    return (backend, *(name for name in auto if name != backend))


def choose(call: Call, backend: str = "auto") -> Choice:
    """The backend that runs ``call`` (see the module docstring); logged when ``log_choices`` is on."""
    if call.phase not in PHASES:  # a KeyError ('*', 'decoding') in the order table
        raise ValueError(f"Call.phase must be one of {', '.join(PHASES)}; got {call.phase!r}")
    names = order(call, backend)
    skipped = []
    chosen = None
    for name in names:
        why = BACKENDS[name].refuses(call)
        if why is None:
            chosen = BACKENDS[name]
            break
        skipped.append((name, why))
    if _log["on"] is None:
        _log["on"] = env_switch("ATTNLAB_BACKENDS", False)
    if _log["on"] and not torch.compiler.is_compiling():
        _log_choice(call, backend, chosen, skipped)
    return Choice(chosen, call, backend, tuple(skipped))


def explain(call: Call, backend: str = "auto") -> str:
    """Which backend runs ``call`` and why every other one does not, in one line."""
    choice = choose(call, backend)
    later = [
        (name, f"after {choice.backend.name} in the order for {call.device} {call.phase}")
        if name in order(call, backend)
        else (name, "not in the order for this call")
        for name in BACKENDS
        if choice.backend is not None and name != choice.backend.name and name not in dict(choice.skipped)
    ]
    return str(choice._replace(skipped=choice.skipped + tuple(later)))


# "on": None until the first choice reads ATTNLAB_BACKENDS (a bad value is then a ValueError, not one at import)
_log: dict[str, object] = {"on": None, "seen": set()}


def log_choices(on: bool = True) -> None:
    """Print each distinct choice to stderr once, as it is first made (also ``ATTNLAB_BACKENDS=1``)."""
    _log.update(on=on, seen=set())


def _log_choice(call: Call, backend: str, chosen: Backend | None, skipped: list[tuple[str, str]]) -> None:
    key = (call, backend, chosen.name if chosen is not None else None)
    seen: set = _log["seen"]  # type: ignore[assignment]
    if key not in seen:
        seen.add(key)
        print(f"attnlab backend: {explain(call, backend)}", file=sys.stderr, flush=True)
