"""Generation with an ``attnlab.model.Transformer``: one prompt or a batch of prompts of different lengths.

Prefill runs each prompt through the model once and scores its last position only (``logits_to_keep=1``: the
vocabulary-wide output head is a (vocab_size x d_model) product per position scored); every further token is
one decode step through the caches. Caches:

    contiguous  the prompts have one length: one ``KVCache``/``LatentCache`` per layer, the prompts prefilled
                together; a row that stops keeps being computed (its tokens are dropped) until all rows stop.
    paged       prompts of different lengths (no padding): one ``PagedKVCache`` per layer, each prompt prefilled
                on its own, then all unfinished rows decoded together; a row that stops leaves the batch and
                its blocks go back to the pool.
    static      prompts of any lengths in ``StaticKVCache``s of the longest prompt + ``max_new_tokens`` slots
                (rounded up to a multiple of ``STATIC_SLOTS``), each prompt prefilled alone into its row when the
                lengths differ, then every row decoded together to the end (as contiguous: a row that stops is
                still computed). Every decode step has the same shapes and reads no Python number that changes,
                so it can be compiled once (``compile=True``: ``torch.compile(fullgraph=True, dynamic=False)``,
                on CUDA with ``mode="reduce-overhead"``, which replays the step as a CUDA graph without a kernel
                launch from Python). Each step hands attention the rows' lengths (see ``cache.StaticKVCache``).

``compile=True`` (static cache only; "auto" then picks it) compiles the decode step of each model once per process
and cache shape: the first call pays the compile (seconds to a minute), later calls of the same shapes reuse it.
The static, compiled step is made for GPUs, where a step of a small model is otherwise bound by Python's kernel
launches; on a CPU it gives up the fused C++ block step (its attention runs in the fused kernel, each row read to its
length) and measured 0.94-1.41x the default cache (benchmarks/generate.py --static, SmolLM-135M's shape).

Tokens: greedy (``temperature=0``) or sampled from ``softmax(logits / temperature)`` restricted to the ``top_k``
likeliest tokens and then to the smallest set whose probability reaches ``top_p`` (the rules of transformers'
``TopKLogitsWarper`` and ``TopPLogitsWarper``), drawn with ``generator`` or a generator seeded with ``seed``.
A row stops after emitting one of ``stop_tokens`` (kept in its output) or after ``max_new_tokens``.

Greedy decoding of a prompt gives the same tokens alone or in any batch, from either cache (tested); samples are
drawn for the batch's rows in order from one generator, so a sampled row depends on the rows before it, and on
the cache once a row has stopped: the contiguous and static caches keep drawing for stopped rows (their tokens
dropped), the paged cache draws for the rows still going. A seed repeats a sample with the same cache (and
``compile``, which takes the static one).

A model with longrope RoPE (Phi-3-128k, Phi-3.5, Phi-4-mini) turns every position by other angles once a forward is
longer than its ``original_max_position_embeddings`` (``rope.switch_length``): the keys its caches hold from shorter
forwards are then stale. A row that grows past that length is prefilled again, whole, at the step it does (as
transformers' Phi-3 drops its cache there), so that the tokens equal those of rerunning the model on the sequence.
This holds for every family with a longrope config: transformers drops the cache for Phi-3 only, so its `generate`
of a Llama-class longrope checkpoint keeps the stale keys past the switch and can give other tokens than its own
forward over the sequence (and than attnlab). A loop of your own over ``Transformer(..., caches=)`` keeps them stale
too, as transformers' own does: prefill again past the switch.
"""

from __future__ import annotations

import math
import operator
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import torch

from .attention import fused
from .attention.rope import switch_length
from .config import AttentionConfig, MLAConfig, check_seed
from .cost import kv_cache_bytes, weight_bytes_read
from .model import Transformer

CACHES = ("auto", "contiguous", "paged", "static")
# A static cache's slots are prompt + new tokens rounded up to a multiple of this: calls of nearby lengths share one
# compiled step (dynamo compiles a shape once, and at most 8 shapes per function: then it runs eagerly), for
# at most this many unwritten slots read per step.
STATIC_SLOTS = 256


@dataclass
class Generation:
    """What ``generate`` made, and how long it took."""

    prompts: list[list[int]]
    tokens: list[list[int]]  # new tokens of each prompt; a stop token that ended a row is its last
    stopped: list[bool]  # True: the row ended on a stop token; False: it reached max_new_tokens
    prefill_s: float  # every prompt through the model and the first new token of each
    decode_s: float  # every later token
    decode_steps: int  # batched decode steps
    decode_rows: int  # rows computed over all decode steps (stopped rows of a contiguous batch included)
    kv_tokens_read: int  # cached tokens attended over all decode steps, summed over rows
    decode_bytes: int  # what the decode steps had to read at least: see ``_Run.account``
    cache: str  # "contiguous", "paged" or "static"
    compile_s: float = 0.0  # a compiled step's warm-up call (its compile, the first time for its shapes)

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens(self) -> int:
        """New tokens made by decode steps (the first token of each row comes with its prefill)."""
        return sum(max(0, len(t) - 1) for t in self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of the whole call, prefill included."""
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total > 0 else float("nan")


def _check_options(max_new_tokens, temperature, top_k, top_p) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    # numbers.Real / numbers.Integral: NumPy's scalars too, as token ids take them (np.float32(0.9) was refused)
    if isinstance(temperature, bool) or not isinstance(temperature, Real) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, Integral) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, Real) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")


def _token_id(x: object, what: str, vocab_size: int) -> int:
    """``x`` as a token id of the vocabulary: a Python, NumPy or one-element tensor integer (not a bool)."""
    try:
        if isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool):
            raise TypeError
        token = operator.index(x)
    except TypeError:
        raise TypeError(f"{what} holds {x!r}, which is not a token id (an integer)") from None
    if not 0 <= token < vocab_size:
        raise ValueError(f"{what} holds token id {token} outside the vocabulary [0, {vocab_size})")
    return token


def _stop_set(stop_tokens: Iterable[int], vocab_size: int) -> set[int]:
    """``stop_tokens`` (a list, set, tuple, array or 1-D tensor of ids) as a set of ints. A set of tensors would hash
    them by identity, and no generated token would ever be found in it."""
    if isinstance(stop_tokens, torch.Tensor):
        stop_tokens = stop_tokens.reshape(-1).tolist() if stop_tokens.ndim <= 1 else stop_tokens
    if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, Iterable):
        raise TypeError(
            f"stop_tokens must be an iterable of token ids (a list, a set, a 1-D tensor), got {stop_tokens!r}"
        )
    return {_token_id(x, "stop_tokens", vocab_size) for x in stop_tokens}


def filter_logits(
    logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """``logits`` (B, vocab) / ``temperature`` in float32, -inf outside the ``top_k`` likeliest tokens and then
    outside the smallest set whose probability reaches ``top_p`` (transformers' Temperature, TopK and TopP
    logits warpers, in that order, with their tie rules); ``temperature`` > 0 (0 is greedy: no sample)."""
    _check_options(0, temperature, top_k, top_p)
    if temperature == 0:
        raise ValueError("filter_logits needs temperature > 0 (temperature 0 is greedy decoding: argmax)")
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = logits.sort(dim=-1)  # ascending: drop the unlikeliest tokens whose mass is <= 1 - p
        drop = torch.softmax(ordered, dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[:, -1] = False  # the likeliest token always stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids (B,) from last-position logits (B, vocab): greedy when ``temperature == 0``."""
    _check_options(0, temperature, top_k, top_p)
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    # The same distribution from logits whose largest is 0: divided by any temperature > 0 they stay finite (a
    # temperature of 1e-40 turned logits of a few units into inf, and the softmax into NaN)
    logits = logits.float()
    logits = logits - logits.amax(dim=-1, keepdim=True)
    # temperature 1e-300, which float32 reads as 0, is the argmax as float32's smallest normal number is
    temperature = max(temperature, torch.finfo(torch.float32).tiny)
    probs = torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    if generator is not None and generator.device != probs.device:  # a CPU generator (seed=) for a CUDA model
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _prompt_lists(prompts: torch.Tensor | Sequence, vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        if prompts.dtype not in (torch.int64, torch.int32) or prompts.ndim not in (1, 2):
            raise ValueError(
                f"prompts must be integer token ids (T,) or (B, T), got {prompts.dtype} {tuple(prompts.shape)}"
            )
        rows = [prompts.tolist()] if prompts.ndim == 1 else prompts.tolist()
    elif isinstance(prompts, Sequence) and not isinstance(prompts, str):
        rows = [p.tolist() if isinstance(p, torch.Tensor) else p for p in prompts]
        if rows and all(not isinstance(x, Iterable) for x in rows):
            rows = [rows]  # one prompt given as a flat list of ids
        rows = [list(r) if isinstance(r, Iterable) and not isinstance(r, (str, bytes)) else r for r in rows]
    else:
        raise TypeError(
            f"prompts must be a tensor or a sequence of token-id sequences, got {type(prompts).__name__}"
        )
    if not rows:
        raise ValueError("prompts is empty: give at least one prompt")
    for i, row in enumerate(rows):
        if not isinstance(row, list):
            raise TypeError(f"prompt {i} is {row!r}, not a sequence of token ids")
        if not row:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        rows[i] = [_token_id(x, f"prompt {i}", vocab_size) for x in row]
    return rows


@torch.inference_mode()
def generate(
    model: Transformer,
    prompts: torch.Tensor | Sequence[Sequence[int] | torch.Tensor],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Iterable[int] = (),
    seed: int | None = None,
    generator: torch.Generator | None = None,
    cache: str = "auto",
    block_size: int = 256,
    compile: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Generation:
    """Extend every prompt by up to ``max_new_tokens`` tokens; see the module docstring.

    ``prompts``: token ids, (T,) or (B, T) tensor, or a sequence of prompts (lists or 1-D tensors) of any
    lengths. ``cache``: "auto" (static with ``compile``, else contiguous when all prompts have one length, else
    paged), "contiguous", "paged" or "static". ``compile``: compile the decode step (static cache only).
    ``progress(done, total)``: called after every decode step with the new tokens made so far (of ``total`` at most).
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be an attnlab.model.Transformer, got {type(model).__name__}")
    _check_options(max_new_tokens, temperature, top_k, top_p)
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {', '.join(CACHES)}; got {cache!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    rows = _prompt_lists(prompts, model.cfg.vocab_size)
    stops = _stop_set(stop_tokens, model.cfg.vocab_size)
    if seed is not None:
        check_seed(seed, "seed")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be None or a torch.Generator, got {type(generator).__name__}")
    if seed is not None and generator is not None:
        raise ValueError("give seed or generator, not both: the seed would be ignored")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be None or a callable (done, total), got {progress!r}")
    if generator is None and seed is not None:
        generator = torch.Generator().manual_seed(seed)
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be a bool, got {type(compile).__name__}")
    one_length = len({len(r) for r in rows}) == 1
    naive = any(getattr(layer.attention, "mode", "auto") == "naive" for layer in model.layers)
    if cache == "auto":  # ragged prompts: paged, or static where MLA's naive mode cannot read pages
        cache = "static" if compile else "contiguous" if one_length else "static" if naive else "paged"
    if compile and cache != "static":
        raise ValueError(f"compile=True compiles the decode step over a static cache; got cache={cache!r}")
    if cache == "contiguous" and not one_length:
        raise ValueError(
            "cache='contiguous' needs prompts of one length; use cache='paged', 'static' or 'auto'"
        )
    if cache == "paged" and naive:
        raise ValueError(
            "cache='paged' needs MLA's absorbed mode: set every layer's attention.mode = 'auto' or 'absorbed' (the "
            "result is the same), or use cache='static' or 'auto'"
        )
    longest = max(len(r) for r in rows) + max_new_tokens
    scalings = {
        dict(getattr(layer.attention.cfg, "rope_scaling", ())).get("rope_type") for layer in model.layers
    }
    # as transformers' generate warns (the command refuses it); dynamic RoPE is made to stretch past it
    if longest > model.cfg.max_seq_len and "dynamic" not in scalings:
        warnings.warn(
            f"a prompt and its {max_new_tokens} new tokens take {longest} positions, past the model's "
            f"max_seq_len {model.cfg.max_seq_len}: positions beyond it are ones the model was not trained on",
            stacklevel=3,  # the caller's line (generate runs under torch.no_grad's wrapper)
        )
    fused.ensure_built(next(model.parameters()).device)  # a first-use build is not prefill time
    run = _Run(model, rows, max_new_tokens, stops, (temperature, top_k, top_p, generator), progress)
    if cache == "static" and run.switches:
        raise ValueError(
            "cache='static' cannot hold a longrope model's keys (they are computed again, whole, once a sequence "
            "passes original_max_position_embeddings); use cache='contiguous' or 'paged'"
            + (", without compile (it decodes over the static cache)" if compile else "")
        )
    if max_new_tokens > 0:
        run.paged(block_size) if cache == "paged" else run.contiguous(cache == "static", compile)
    return Generation(
        prompts=rows,
        tokens=run.out,
        stopped=run.stopped,
        prefill_s=run.prefill_s,
        decode_s=run.decode_s,
        decode_steps=run.steps,
        decode_rows=run.decode_rows,
        kv_tokens_read=run.kv_tokens,
        decode_bytes=run.bytes,
        cache=cache,
        compile_s=run.compile_s,
    )


class _Run:
    """The state of one ``generate`` call: the tokens made so far and the clocks."""

    def __init__(
        self,
        model: Transformer,
        rows: list[list[int]],
        max_new: int,
        stops: set[int],
        sampling,
        progress=None,
    ) -> None:
        self.model, self.rows, self.max_new, self.stops, self.sampling = model, rows, max_new, stops, sampling
        self.progress = progress
        self.out: list[list[int]] = [[] for _ in rows]
        self.stopped = [False] * len(rows)
        self.prefill_s = self.decode_s = self.compile_s = 0.0
        self.steps = self.decode_rows = self.kv_tokens = self.bytes = 0
        self.dtype = next(model.parameters()).dtype
        self.windowed = any(getattr(a, "window", None) is not None for a in model.cfg.layer_attentions)
        self.device = next(model.parameters()).device
        # cache lengths at which a decode step would be the first forward past a longrope layer's switch
        self.switches = {
            n
            for layer in model.layers
            if (n := switch_length(getattr(layer.attention.cfg, "rope_scaling", ()))) is not None
        }

    def ids(self, rows: list[list[int]]) -> torch.Tensor:
        """Token ids as a tensor where the weights are (CPU or CUDA)."""
        return torch.tensor(rows, device=self.device)

    def _take(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Sample a token for each of ``rows`` (one logits row each); record it; return them (len(rows),)."""
        nxt = sample_next(logits, *self.sampling)
        for row, token in zip(rows, nxt.tolist(), strict=True):
            if not self.done(row):
                self.out[row].append(token)
                self.stopped[row] = token in self.stops
        if self.progress is not None:
            self.progress(sum(len(t) for t in self.out), self.max_new * len(self.rows))
        return nxt

    def account(self, attended: list[int]) -> None:
        """Count one decode step whose rows attend ``attended`` cached tokens each: the bytes it must read are the
        weights once (``cost.weight_bytes_read``) and each row's keys and values (or MLA latents) in every layer
        (``cost.kv_cache_bytes``: a sliding layer reads at most its window of each row), the roofline's
        numerator."""
        cfg = self.model.cfg
        self.steps += 1
        self.decode_rows += len(attended)
        self.kv_tokens += sum(attended)
        if self.windowed:
            kv = sum(kv_cache_bytes(cfg, 1, n, self.dtype) for n in attended)
        else:  # every layer reads every token: one count for the rows' sum
            kv = kv_cache_bytes(cfg, 1, sum(attended), self.dtype)
        self.bytes += weight_bytes_read(cfg, len(attended), self.dtype) + kv

    def done(self, row: int) -> bool:
        return self.stopped[row] or len(self.out[row]) >= self.max_new

    def contiguous(self, static: bool = False, compiled: bool = False) -> None:
        """Every row decoded together to the end: prompts of one length in contiguous caches, or in (``static``)
        ``StaticKVCache``s prompts of any lengths, each prefilled alone into its row when they differ, whose decode
        step may be ``compiled``. ``held``: each row's cached tokens, counted on the host (a static cache's count is
        on its device)."""
        model, b = self.model, len(self.rows)
        held = [len(r) for r in self.rows]
        start = time.perf_counter()
        slots = max(held) + self.max_new
        caches = model.new_caches(
            b, -(-slots // STATIC_SLOTS) * STATIC_SLOTS if static else slots, static=static
        )
        if len(set(held)) == 1:
            tokens = self.ids(self.rows)
            first = model(tokens, caches=caches, logits_to_keep=1)[:, -1]
        else:  # a ragged batch (static caches only)
            first = torch.cat([
                model(self.ids([p]), caches=[c.row(i) for c in caches], logits_to_keep=1)[:, -1]
                for i, p in enumerate(self.rows)
            ])  # fmt: skip
        nxt = self._take(first, list(range(b)))
        self.prefill_s = time.perf_counter() - start
        step = _step
        if compiled and not all(self.done(r) for r in range(b)):
            start = time.perf_counter()
            step = decode_step(model)
            step(model, nxt[:, None], caches)  # compiles, the first time for these shapes; then taken back
            for c in caches:
                c.rewind(1)
            self.compile_s = time.perf_counter() - start
        start = time.perf_counter()
        while not all(self.done(r) for r in range(b)):
            if self.switches:  # every row's tokens so far (the newest not yet run), to prefill again
                tokens = torch.cat((tokens, nxt[:, None]), dim=1)
            if held[0] in self.switches:  # past a longrope switch: every row (of one length) again, whole
                for c in caches:
                    c.reset()
                logits = model(tokens, caches=caches, logits_to_keep=1)[:, -1]
            else:
                self.account([n + 1 for n in held])
                logits = step(model, nxt[:, None], caches)
            held = [n + 1 for n in held]
            nxt = self._take(logits, list(range(b)))
        self.decode_s = time.perf_counter() - start

    def pool(self, attn: AttentionConfig | MLAConfig, block_size: int) -> int:
        """Blocks of one layer's paged pool: every row's whole sequence, or for a sliding-window layer (whose cache
        gives back the blocks that leave its window before each update) what a row holds at most, its prompt after
        the prefill or the blocks its window can touch afterwards. A longrope switch prefills a row again whole,
        so a model with one keeps whole pools."""
        window = getattr(attn, "window", None)
        whole = [-(-(len(r) + self.max_new) // block_size) for r in self.rows]
        if window is None or self.switches:
            return sum(whole)
        spans = (window - 1) // block_size + 2
        return sum(
            min(w, max(-(-len(r) // block_size), spans)) for w, r in zip(whole, self.rows, strict=True)
        )

    def paged(self, block_size: int) -> None:
        model, b = self.model, len(self.rows)
        start = time.perf_counter()
        caches = [
            layer.attention.new_paged_cache(self.pool(layer.attention.cfg, block_size), block_size, b)
            for layer in model.layers
        ]
        first = []
        for row, prompt in enumerate(self.rows):
            logits = model(self.ids([prompt]), caches=[c.select([row]) for c in caches], logits_to_keep=1)
            first.append(logits[:, -1])
        nxt = self._take(torch.cat(first), list(range(b)))
        self.prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        last = dict(enumerate(nxt.tolist()))  # each live row's newest token
        while True:
            for row in [r for r in last if self.done(r)]:
                del last[row]
                for c in caches:
                    c.free(row)
            if not last:
                break
            # a row past a longrope switch is prefilled again, whole and alone; the others take one decode step
            again = [r for r in sorted(last) if caches[0].lengths[r] in self.switches]
            active = [r for r in sorted(last) if r not in again]
            logits = {}
            for row in again:
                for c in caches:
                    c.free(row)
                whole = self.ids([self.rows[row] + self.out[row]])
                logits[row] = model(whole, caches=[c.select([row]) for c in caches], logits_to_keep=1)[0, -1]
            if active:
                for c in caches:
                    c.select(active)
                self.account([caches[0].lengths[r] + 1 for r in active])
                step = model(self.ids([[last[r]] for r in active]), caches=caches)[:, -1]
                logits |= dict(zip(active, step, strict=True))
            rows = sorted(logits)
            for row, token in zip(
                rows, self._take(torch.stack([logits[r] for r in rows]), rows).tolist(), strict=True
            ):
                last[row] = token
        self.decode_s = time.perf_counter() - start


def _step(model: Transformer, tokens: torch.Tensor, caches: list) -> torch.Tensor:
    """One decode step: the logits (B, vocab) of the tokens (B, 1) after the cached ones."""
    return model(tokens, caches=caches)[:, -1]


_COMPILED: dict[str, Callable[..., torch.Tensor]] = {}


def decode_step(model: Transformer) -> Callable[..., torch.Tensor]:
    """``_step`` compiled for the model's device type: ``fullgraph=True`` (a graph break is an error, not a slow
    step) and ``dynamic=False`` (the static caches' shapes never change); on CUDA ``mode="reduce-overhead"``, which
    records the step as a CUDA graph and replays it (the caches' buffers are static addresses, so the replay writes
    them in place). One compiled function per device type, shared by every model: dynamo keys its graphs on the
    model's parameters and the caches' shapes, so a new model or cache size compiles again, a new call of the same
    shapes does not. Past dynamo's recompile limit (``torch._dynamo.config.recompile_limit`` graphs of ``_step`` in a
    process: 8 models or shapes by default), where ``fullgraph`` raises, a step of a new shape runs eagerly, with a
    warning once."""
    kind = next(model.parameters()).device.type
    if kind not in _COMPILED:
        mode = "reduce-overhead" if kind == "cuda" else None
        _COMPILED[kind] = torch.compile(_step, fullgraph=True, dynamic=False, mode=mode)
    compiled = _COMPILED[kind]
    # set once the limit is hit: this generation's later steps (its shapes) go eager at once
    eager: list[bool] = []

    def run(*args):
        if eager:  # another try would fail again, slower than the step, with torch's warning each time
            return _step(*args)
        if kind == "cuda":  # the last step's outputs are consumed: its graph may be reused
            torch.compiler.cudagraph_mark_step_begin()
        try:
            return compiled(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:  # raised before the step runs: nothing written yet
            eager.append(True)
            if not _EAGER_WARNED:
                _EAGER_WARNED.append(True)
                warnings.warn(
                    "attnlab: the compiled decode step reached dynamo's recompile limit (torch._dynamo.config."
                    f"recompile_limit = {torch._dynamo.config.recompile_limit} models or shapes in this process); "
                    "steps of new shapes run eagerly (raise the limit to compile them)",
                    stacklevel=2,
                )
            return _step(*args)

    return run


_EAGER_WARNED: list[bool] = []  # the recompile limit's warning, once per process
