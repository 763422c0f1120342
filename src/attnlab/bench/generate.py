"""``attnlab generate``: text from a checkpoint, with the speed of prefill and decode against the roofline.

The roofline of the decode phase is the time needed to read, per step, every weight once and the cached keys and
values (or MLA latents) of every token attended (``Generation.decode_bytes``, counted with ``attnlab.cost``) at
the given ``--bandwidth`` or the measured streaming read bandwidth of the device it runs on
(``bench.machine.device_bandwidth``; a CPU's is measured once per boot and cached, as for ``attnlab bench``); "of
roofline" is that time over the measured decode time (1.0 = at the limit).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ..atomic import json_text, read_json
from ..config import check_seed
from ..console import Grid, print_grid
from ..cost import weight_bytes_read
from ..generate import CACHES, generate

DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}


# inference mode, as generate's: calls skip the Autograd key, whose check on the kernels' operators costs a few
# microseconds per call under no_grad
@torch.inference_mode()
def decode_step_times(
    models: dict[Any, torch.nn.Module], prompt: torch.Tensor, steps: int, repeats: int
) -> tuple[dict[Any, list[float]], dict[Any, int]]:
    """Seconds of ``steps`` greedy decode steps after prefilling ``prompt`` (B, T), for each model ``repeats``
    times, round robin over the models (a slow spell of a shared machine then hits every model alike); and the
    bytes of each model's filled caches. The models and ``prompt`` are on one device."""
    b, t = prompt.shape
    times: dict[Any, list[float]] = {name: [] for name in models}
    nbytes: dict[Any, int] = {}
    for _ in range(repeats):
        for name, model in models.items():
            caches = model.new_caches(b, t + steps)
            # the last position scored only, as generate's prefill does (B x T x vocab logits did not fit at a
            # sweep's --batch 1000 with 32000 tokens of vocabulary, failing every row)
            nxt = model(prompt, caches=caches, logits_to_keep=1).argmax(-1)
            start = time.perf_counter()
            for _ in range(steps):
                nxt = model(nxt, caches=caches)[:, -1:].argmax(-1)
            if nxt.device.type == "cuda":
                torch.cuda.synchronize(
                    nxt.device
                )  # a GPU's kernels run asynchronously: wait for the last step
            times[name].append(time.perf_counter() - start)
            nbytes[name] = sum(c.nbytes for c in caches)
    return times, nbytes


def _one_dtype(model: torch.nn.Module, ckpt: Path) -> torch.dtype | None:
    """``--dtype auto`` for a checkpoint whose tensors mix dtypes (bfloat16 weights with float32 norms or head, as
    some are saved): the config's dtype, as transformers' ``dtype="auto"`` loads it, else the one most weights
    have. None: the tensors share one dtype already."""
    kinds = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(kinds) <= 1:
        return None
    from ..hf import io

    raw = io.read_config(ckpt)
    named = raw.get("dtype", raw.get("torch_dtype"))
    by_name = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if named in by_name:
        return by_name[named]
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__)


def stop_tokens(ckpt: Path, tokenizer, extra: list[str], ignore_eos: bool, vocab_size: int) -> set[int]:
    """The checkpoint's ``eos_token_id`` (unless ``ignore_eos``) as transformers' ``generate`` takes it: from
    generation_config.json where there is one, else from config.json; plus every ``--stop`` text, each of which
    must be exactly one token of the vocabulary."""
    stops: set[int] = set()
    if not ignore_eos:
        for name in ("generation_config.json", "config.json"):
            path = ckpt / name
            if path.is_file() and path.stat().st_size > 2**24:  # a link to /dev/zero grew to 9 GB
                continue
            try:  # read_json takes regular files only: a FIFO there hung
                settings = read_json(path)
            except (OSError, ValueError):
                continue  # absent, or a malformed generation config: its eos is unknown, not fatal
            eos = settings.get("eos_token_id")
            for token in eos if isinstance(eos, list) else [eos]:
                # an id the model cannot produce never stops it (transformers' generate takes it so); it was
                # refused as "stop_tokens holds token id ... outside the vocabulary", naming neither file nor field
                if isinstance(token, int) and not isinstance(token, bool) and 0 <= token < vocab_size:
                    stops.add(token)
            break
    # a special token is its own text; any other is looked up by encoding: the vocabulary's strings are in the
    # tokenizer's alphabet (byte-level: 'é' is the symbol of byte 0xE9, half of another character's bytes)
    added = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
    byte_level = type(tokenizer.decoder).__name__ == "ByteLevel"
    space = tokenizer.token_to_id("▁")  # SentencePiece's word start, which its normalizer prepends
    for text in extra:
        token = added.get(text)
        if token is None:
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            if len(ids) == 2 and ids[0] == space and space is not None and not text.startswith((" ", "▁")):
                ids = ids[1:]  # "\n" as "▁" + "<0x0A>": the prefix the text did not ask for
            named = None if byte_level else tokenizer.token_to_id(text)
            if len(ids) != 1 and named is not None:
                # a vocabulary string no text encodes to alone: SentencePiece's newline "<0x0A>" ("\n" encodes
                # as "▁" + "<0x0A>"); a byte-level vocabulary's strings are bytes' symbols, never taken so
                ids = [named]
            if len(ids) != 1:
                raise ValueError(
                    f"--stop {text!r} is {len(ids)} tokens in this vocabulary; give a single token"
                )
            token = ids[0]
            unknown = getattr(tokenizer.model, "unk_token", None)
            if unknown is not None and token == tokenizer.token_to_id(unknown):
                raise ValueError(f"--stop {text!r} is not in this vocabulary (it encodes as {unknown!r})")
        stops.add(token)
    return stops


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """The sampling flags, named as the command takes them; ``--top-k`` / ``--top-p`` only narrow a sample, so
    without ``--temperature`` (greedy decoding, which ignores them) they are refused rather than silently unused."""
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"--temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
    given = [f for f, v in (("--top-k", top_k), ("--top-p", top_p)) if v is not None]
    if temperature == 0 and given:
        raise ValueError(
            f"{' and '.join(given)} choose{'s' if len(given) == 1 else ''} among the tokens to sample, but without "
            "--temperature decoding is greedy and would ignore it: add --temperature (e.g. 0.8) to sample"
        )


def run_generate(
    ckpt: Path,
    prompts: list[str],
    *,
    max_new: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    seed: int,
    stop: list[str],
    ignore_eos: bool,
    dtype: str,
    as_json: bool,
    bandwidth_gbs: float | None = None,
    device: str = "auto",
    cache: str = "auto",
    compile_step: bool = False,
) -> dict[str, Any]:
    from .. import resources
    from ..console import Progress
    from ..cost import kv_cache_bytes
    from ..data import load_tokenizer
    from ..hf.causal_lm import load_causal_lm
    from .machine import device_bandwidth

    where = resources.resolve_device(device)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if not prompts:
        raise ValueError("give at least one --prompt")
    if max_new < 1:
        raise ValueError(f"--max-new must be >= 1, got {max_new}")
    if cache not in CACHES:
        raise ValueError(f"--cache must be one of {', '.join(CACHES)}; got {cache!r}")
    if compile_step and cache not in ("auto", "static"):
        raise ValueError(f"--compile compiles the decode step over the static cache; got --cache {cache}")
    check_sampling(temperature, top_k, top_p)
    check_seed(seed)
    for text in prompts:  # a shell argument in another encoding arrives with surrogate escapes
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"--prompt {text!r} is not valid UTF-8 text") from None
    if bandwidth_gbs is not None and not 0 < bandwidth_gbs < float("inf"):
        raise ValueError(f"--bandwidth must be a number of GB/s > 0, got {bandwidth_gbs}")
    model = load_causal_lm(ckpt)
    tokenizer = load_tokenizer(ckpt, model.cfg.vocab_size)
    wanted = DTYPES[dtype] if DTYPES[dtype] is not None else _one_dtype(model, ckpt)
    if wanted is not None:
        model = model.to(wanted)
    ids = [tokenizer.encode(text).ids for text in prompts]
    for text, row in zip(prompts, ids, strict=True):
        if not row:
            raise ValueError(f"--prompt {text!r} is no tokens at all")
        if len(row) + max_new > model.cfg.max_seq_len:
            raise ValueError(
                f"--prompt of {len(row)} tokens + --max-new {max_new} exceeds the checkpoint's "
                f"max_position_embeddings={model.cfg.max_seq_len}"
            )
    param_dtype = next(model.parameters()).dtype
    longest = max(len(row) for row in ids) + max_new
    if where.type == "cpu":  # the weights are loaded; the caches of every prompt come on top
        resources.check_fits(
            kv_cache_bytes(model.cfg, len(ids), longest, param_dtype),
            f"{len(ids)} --prompt x {longest} tokens (prompt + --max-new)",
            "lower --max-new or give fewer prompts",
        )
    if cache == "contiguous" and len({len(row) for row in ids}) > 1:
        raise ValueError(
            f"--cache contiguous needs prompts of one length in tokens; these have {sorted({len(r) for r in ids})} "
            "(use --cache auto, paged or static)"
        )
    stops = stop_tokens(ckpt, tokenizer, stop, ignore_eos, model.cfg.vocab_size)
    model = model.to(where)  # generate() puts the caches and token ids where the weights are
    resources.announce_device(where)
    with Progress("generate (tokens)", max_new * len(ids)) as bar:
        gen = generate(
            model, ids, max_new, temperature=temperature, top_k=top_k, top_p=top_p, stop_tokens=stops, seed=seed,
            cache=cache, compile=compile_step, progress=lambda done, total: bar.update(done, total=total),
        )  # fmt: skip
    bandwidth = device_bandwidth(where) if bandwidth_gbs is None else bandwidth_gbs * 1e9
    n_bytes = gen.decode_bytes
    fraction = n_bytes / bandwidth / gen.decode_s if gen.decode_steps and gen.decode_s > 0 else None
    result = {
        "checkpoint": str(ckpt),
        "dtype": str(param_dtype).removeprefix("torch."),
        "device": str(where),
        "threads": torch.get_num_threads(),
        "cache": gen.cache,
        "compiled": compile_step,
        "sampling": {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed},
        "stop_tokens": sorted(stops),
        "outputs": [
            {
                "prompt": text,
                "prompt_tokens": len(row),
                "tokens": new,
                "text": tokenizer.decode(new, skip_special_tokens=True),
                "stopped": stopped,
            }
            for text, row, new, stopped in zip(prompts, ids, gen.tokens, gen.stopped, strict=True)
        ],
        "new_tokens": gen.new_tokens,
        "prefill_s": gen.prefill_s,
        "decode_s": gen.decode_s,
        "compile_s": gen.compile_s,
        "decode_steps": gen.decode_steps,
        "decode_tokens_per_s": gen.decode_tokens_per_s if gen.decode_tokens else None,
        "tokens_per_s": gen.tokens_per_s,
        "weight_bytes_per_step": weight_bytes_read(model.cfg, len(prompts), param_dtype),  # all rows live
        "decode_bytes": n_bytes,
        "bandwidth_bytes_per_s": bandwidth,
        "bandwidth_measured": bandwidth_gbs is None,
        "roofline_fraction": fraction,
    }
    if as_json:
        print(json_text(result, indent=1), end="")
    else:
        print_result(result)
    return result


def _decimal_bytes(n: float) -> str:
    """Bytes in the decimal unit of the bandwidth beside them (GB/s), with digits to show: a small model's step
    reads megabytes, which "0.00 GB" hid."""
    for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.2f} {name}"
    return f"{n:.0f} B"


def print_result(result: dict[str, Any]) -> None:
    texts = Grid("attnlab generate", ["prompt", "tokens in", "tokens out", "ended by", "text"], right=(1, 2))
    for out in result["outputs"]:
        ended = "stop token" if out["stopped"] else "--max-new"
        texts.add_row(out["prompt"], str(out["prompt_tokens"]), str(len(out["tokens"])), ended, out["text"])
    print_grid(texts)
    speed = Grid("speed", ["phase", "seconds", "tokens/s", "note"], right=(1, 2))
    cache = f"{result['cache']} cache" + (", compiled decode step" if result.get("compiled") else "")
    speed.add_row("prefill + first token", f"{result['prefill_s']:.3f}", "", cache)
    per_s = result["decode_tokens_per_s"]
    fraction = result["roofline_fraction"]
    roof = (
        f"{fraction:.2f} of the roofline ({_decimal_bytes(result['decode_bytes'])} read in "
        f"{result['decode_steps']} steps, at {result['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
        f"{'measured' if result['bandwidth_measured'] else 'given'})"
        if fraction is not None
        else "no decode step"
    )
    if result.get("compiled"):
        speed.add_row(
            "compile (decode step)", f"{result['compile_s']:.3f}", "", "not in decode or end to end"
        )
    speed.add_row("decode", f"{result['decode_s']:.3f}", f"{per_s:.1f}" if per_s else "", roof)
    speed.add_row(
        "end to end", f"{result['prefill_s'] + result['decode_s']:.3f}", f"{result['tokens_per_s']:.1f}", ""
    )
    speed.caption = f"{result['dtype']}, {result['device']}, {result['threads']} threads"
    print_grid(speed)
