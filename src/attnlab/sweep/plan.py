"""What a sweep runs: its options, the variants (``--variants``), and the jobs (convert, uptrain, eval, speed) that
``attnlab.jobs.run_jobs`` caches and runs.

Variants: ``gqa:G,...`` (G divides the source's KV heads and is smaller; G = 1 is MQA), ``mla:R,...`` (the latent
rank; the rotary width is DeepSeek-V2's d_h / 2, ``attnlab.cost.sweep.mla_alternative``, unless written ``R+D``: rank
R and D rotary dims, a cache of R + D values per token and layer), or ``auto``: every GQA
group count that divides the source's KV heads down to MQA, and MLA at the ranks whose KV bytes per token equal
each GQA row's and the source's, so that rows compare at equal cache. ``--quick`` makes ``auto`` three variants:
the two smallest GQA group counts and MLA at the larger one's bytes. A spec may end in ``/M,M``: the methods of its
variants, instead of ``--methods`` (``gqa:4,2/mean,fit mla:56+8/fit``).

Methods: GQA takes every ``attnlab convert --method``; MLA's conversion has no pooling method, only calibration
text or none, so for MLA a data-aware method (fit, grouped-fit) reads "calib" and any other "plain" (rows that
would be the same conversion are listed once).

Decode timing (``timing``): "each" times every variant in a job of its own (cached per variant, so adding a variant
times only it); "together" times the source and every variant in one job, in turn (round robin), so that their
ratios come from one process and the same moments of a shared machine.
"""

from __future__ import annotations

import math
import random
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..config import AttentionConfig, ModelConfig
from ..convert.gqa import METHODS
from ..convert.mla import full_rank
from ..convert.model import DATA_AWARE
from ..cost import kv_cache_bytes
from ..cost.hardware import HARDWARE_NAMES
from ..cost.sweep import mla_alternative
from ..data import fingerprint, load_tokenizer, read_text, split_held_out, text_files
from ..hf.io import files_id
from ..jobs import Job, torch_threads
from ..resources import check_fits, resolve_device
from . import work

KEEP = ("none", "best", "all")
TIMING = ("each", "together")
DEFAULT_STEPS = (0, 50, 200)
QUICK_STEPS = (0, 50)


@dataclass(frozen=True)
class Variant:
    name: str  # "gqa-2", "mqa", "mla-28"; "source"
    kind: str  # "source", "gqa", "mla"
    n_kv_heads: int | None = None
    kv_lora_rank: int | None = None
    rope_dim: int | None = None
    methods: tuple[str, ...] | None = None  # None: the sweep's --methods


@dataclass(frozen=True)
class SweepOptions:
    src: Path
    data: Path
    eval_data: Path | None = None
    variants: tuple[str, ...] = ("auto",)
    methods: tuple[str, ...] = ("mean", "fit")
    uptrain_steps: tuple[int, ...] | None = None  # None: DEFAULT_STEPS, QUICK_STEPS with quick
    teacher: str = "src"  # "src", "none" or a checkpoint directory
    context: int = 4096
    batch: int = 1
    hardware: tuple[str, ...] = ("h100",)
    jobs: int = 1
    out: Path | None = None
    quick: bool = False
    keep: str = "all"
    seq_len: int | None = None  # uptraining and evaluation windows (default min(256, positions); quick 128)
    batch_size: int = 8
    lr: float = 3e-4
    eval_windows: int | None = None  # None: 256, quick 64
    seed: int = 0  # uptraining's data order and init of what it adds
    warmup: float | None = (
        None  # uptraining's warmup as a fraction of its steps (None: attnlab uptrain's 5 %)
    )
    distill_weight: float = 0.5  # weight of the KL to the teacher (attnlab uptrain's default)
    temperature: float = 2.0
    timing: str = "each"  # "each" or "together" (module docstring)
    timing_steps: int | None = None  # decode steps timed (None: 16, quick 8)
    timing_repeats: int | None = None  # the fastest of this many (None: 5, quick 3)
    # the threads a timing runs on (None: this process's torch threads); a caller that gives run_jobs another count
    # for its lone jobs (the studies: one thread per worker, all of them for a timing) says so here
    timing_threads: int | None = None
    device: str = "auto"  # where the jobs run models (resources.resolve_device)

    @property
    def steps(self) -> tuple[int, ...]:
        if self.uptrain_steps is not None:
            return self.uptrain_steps
        return QUICK_STEPS if self.quick else DEFAULT_STEPS


def parse_ints(text: str, flag: str) -> tuple[int, ...]:
    """A comma list of plain decimal integers (Python's int() would also take "2_8" as 28, and other scripts'
    digits)."""
    items = [x.strip() for x in text.split(",")]  # an empty item is refused, not dropped ("100," ran as 100)
    if not all(re.fullmatch(r"-?[0-9]+", x) for x in items):
        raise ValueError(f"{flag} takes a comma list of integers, got {text!r}")
    values = tuple(int(x) for x in items)
    if not values:
        raise ValueError(f"{flag} takes a comma list of integers, got {text!r}")
    return values


def _uptrain_takes(opts: SweepOptions) -> None:
    """The uptraining recipe refused here, as ``attnlab uptrain`` refuses it (UptrainOptions' own checks, the seed's
    range among them): one that only the jobs refused (``--temperature 0.005``, a seed past 2**64) failed each row,
    with exit 0."""
    from ..train import UptrainOptions

    here = Path(".")
    UptrainOptions(src=here, dst=here, data=here, steps=1, batch_size=opts.batch_size, lr=opts.lr, seed=opts.seed,
                   distill_weight=opts.distill_weight, temperature=opts.temperature)  # fmt: skip


def check_options(opts: SweepOptions) -> None:
    """Refuse bad options before anything is loaded, naming the flag."""
    for field in ("src", "data"):
        if not isinstance(getattr(opts, field), Path):
            raise TypeError(f"SweepOptions.{field} must be a pathlib.Path, got {getattr(opts, field)!r}")
    for field in ("eval_data", "out"):
        if getattr(opts, field) is not None and not isinstance(getattr(opts, field), Path):
            raise TypeError(
                f"SweepOptions.{field} must be None or a pathlib.Path, got {getattr(opts, field)!r}"
            )
    for flag, values in (("--variants", opts.variants), ("--methods", opts.methods),
                         ("--uptrain-steps", opts.steps), ("--hardware", opts.hardware)):  # fmt: skip
        if isinstance(values, (list, str)):  # a list read as "no value"; a str as its characters
            kind = "a tuple of strings" if flag != "--uptrain-steps" else "a tuple of integers"
            raise TypeError(f"SweepOptions: {flag} takes {kind}, got {type(values).__name__} {values!r}")
        if (
            not isinstance(values, tuple)
            or not values
            or any(isinstance(v, str) and not v.strip() for v in values)
        ):
            raise ValueError(f"{flag} needs at least one value and no empty ones, got {values!r}")
        if len(set(values)) != len(values):  # two rows, jobs or columns of one name
            raise ValueError(f"{flag} lists a value twice: {','.join(map(str, values))}")
    if any(isinstance(s, bool) or not isinstance(s, int) for s in opts.steps):
        raise ValueError(f"--uptrain-steps must be integers, got {opts.steps!r}")
    for flag, value in (("--lr", opts.lr), ("--distill-weight", opts.distill_weight),
                        ("--temperature", opts.temperature)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{flag} must be a number, got {value!r}")
    if opts.warmup is not None and (
        isinstance(opts.warmup, bool) or not isinstance(opts.warmup, (int, float))
    ):
        raise TypeError(f"--warmup must be None or a number, got {opts.warmup!r}")
    for m in opts.methods:
        if m not in METHODS:
            raise ValueError(f"--methods: {m!r} is not a method; choose among {', '.join(METHODS)}")
    if any(s < 0 for s in opts.steps):
        raise ValueError(f"--uptrain-steps must be >= 0, got {','.join(map(str, opts.steps))}")
    for name in opts.hardware:
        if name not in HARDWARE_NAMES:
            raise ValueError(f"--hardware {name!r}: choose among {', '.join(HARDWARE_NAMES)}")
    if opts.keep not in KEEP:
        raise ValueError(f"--keep must be one of {', '.join(KEEP)}; got {opts.keep!r}")
    for flag, value in (("--context", opts.context), ("--batch", opts.batch), ("--jobs", opts.jobs),
                        ("--batch-size", opts.batch_size)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
    if not 0 < opts.lr < math.inf:  # inf ran every other job, then failed each uptraining (exit 0)
        raise ValueError(f"--lr must be a finite number > 0, got {opts.lr}")
    if opts.warmup is not None and not 0 <= opts.warmup <= 1:
        raise ValueError(f"--warmup is a fraction of the uptraining steps in [0, 1], got {opts.warmup}")
    if not 0 <= opts.distill_weight <= 1:
        raise ValueError(f"--distill-weight must be in [0, 1], got {opts.distill_weight}")
    if not 0 < opts.temperature < math.inf:
        raise ValueError(f"--temperature must be a finite number > 0, got {opts.temperature}")
    _uptrain_takes(opts)
    if opts.timing not in TIMING:
        raise ValueError(f"--timing must be one of {', '.join(TIMING)}; got {opts.timing!r}")
    for flag, value, least in (("timing_steps", opts.timing_steps, 1), ("timing_repeats", opts.timing_repeats, 1),
                               ("timing_threads", opts.timing_threads, 1), ("--seq-len", opts.seq_len, 1),
                               ("--eval-windows", opts.eval_windows, 0)):  # fmt: skip
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ValueError(f"{flag} must be an integer >= {least}, got {value!r}")
    if opts.teacher not in ("src", "none") and not (Path(opts.teacher) / "config.json").is_file():
        raise ValueError(
            f"--teacher {opts.teacher}: not a checkpoint directory (no config.json); or src, or none"
        )


def check_against(opts: SweepOptions, cfg: ModelConfig, device: str = "cpu") -> None:
    """Refuse options the source's config rules out, before any job runs; and on the CPU, a timing whose caches
    this machine cannot hold (each row failed with torch's allocation error, exit 0)."""
    if opts.seq_len is not None and opts.seq_len > cfg.max_seq_len:
        raise ValueError(
            f"--seq-len {opts.seq_len} is longer than the source's {cfg.max_seq_len} positions "
            "(its max_position_embeddings)"
        )
    timing = timing_args(opts)
    if device == "cpu":
        # the source's cache as work.speed fills it (its context capped by the positions), and its prefill's
        # hidden states (float32, the MLP's the widest), at least
        context = max(1, min(opts.context, cfg.max_seq_len - timing["steps"]))
        need = kv_cache_bytes(cfg, opts.batch, context + timing["steps"], "fp32")
        need += 4 * opts.batch * context * (cfg.attention.d_model + cfg.ffn_dim)
        # past the cap, a lower --context changes nothing
        lower = "--batch" if context < opts.context else "--batch or --context"
        check_fits(need, f"--batch {opts.batch} x {context} tokens (the decode timing's prefill and cache; "
                   f"--context {opts.context}, at most the source's positions less the timed steps)",
                   f"lower {lower}")  # fmt: skip


def _gqa(g: int, methods: tuple[str, ...] | None) -> Variant:
    return Variant("mqa" if g == 1 else f"gqa-{g}", "gqa", n_kv_heads=g, methods=methods)


def _mla(rank: int, rope: int, methods: tuple[str, ...] | None) -> Variant:
    return Variant(f"mla-{rank}", "mla", kv_lora_rank=rank, rope_dim=rope, methods=methods)


def _spec_methods(part: str, text: str) -> tuple[str, ...]:
    methods = tuple(m.strip() for m in text.split(","))  # an empty item is refused ("mean," ran as mean)
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"--variants {part}: {m!r} is not a method; choose among {', '.join(METHODS)}")
    return methods


def _mla_ranks(part: str, values: str, rope: int) -> list[tuple[int, int]]:
    """``R,R+D,...``: (rank, rotary dims) pairs; a bare R takes the default rotary width ``rope``."""
    out = []
    for item in values.split(","):
        rank, plus, dims = item.partition("+")
        (r,) = parse_ints(rank, "--variants mla:")
        d = parse_ints(dims, "--variants mla:R+")[0] if plus else rope
        if r < 1 or d < 1:
            raise ValueError(f"--variants {part}: a latent rank and its rotary dims are >= 1, got {item!r}")
        out.append((r, d))
    return out


def variants(cfg: ModelConfig, spec: tuple[str, ...], quick: bool) -> list[Variant]:
    """The variants of ``--variants`` for a source of config ``cfg`` (see the module docstring)."""
    attn = cfg.attention
    if not isinstance(attn, AttentionConfig):
        raise ValueError("the sweep's source must be an MHA / GQA checkpoint (its attention is already MLA)")
    n_kv, hd = attn.n_kv_heads, attn.head_dim
    rope = mla_alternative(cfg).qk_rope_head_dim
    out: list[Variant] = []
    for part in spec:
        head, slash, method_text = part.partition("/")
        methods = _spec_methods(part, method_text) if slash else None
        kind, _, values = head.partition(":")
        if kind == "auto" and not values:
            groups = [g for g in range(n_kv - 1, 0, -1) if n_kv % g == 0]
            if quick:  # an MQA source has no smaller GQA: MLA at its own bytes
                groups = groups[-2:]
                ranks = [2 * (groups or [n_kv])[0] * hd - rope]
            else:
                ranks = [2 * g * hd - rope for g in (n_kv, *groups)]
            # MLA at the bytes of the source or a GQA row: only the ranks the conversion can reach (an MHA
            # source's own bytes exceed what its stacked keys and values hold)
            reachable = [r for r in ranks if 0 < r <= full_rank(attn, rope)]
            out += [_gqa(g, methods) for g in groups] + [_mla(r, rope, methods) for r in reachable]
        elif kind == "gqa" and values:
            for g in parse_ints(values, "--variants gqa:"):
                if not 1 <= g < n_kv or n_kv % g:
                    raise ValueError(
                        f"--variants gqa:{g}: the source has {n_kv} KV heads; choose a number from 1 up to "
                        f"{n_kv - 1} that divides it"
                    )
                out.append(_gqa(g, methods))
        elif kind == "mla" and values:
            out += [_mla(r, d, methods) for r, d in _mla_ranks(part, values, rope)]
        else:
            raise ValueError(
                f"--variants takes gqa:G,G,... mla:R,R+D,... or auto (each /M,M optional); got {part!r}"
            )
    seen: dict[str, Variant] = {}
    for v in out:
        # the same row asked for twice, two ways: say so, drop neither silently
        if seen.setdefault(v.name, v) != v:
            raise ValueError(
                f"--variants asks for {v.name} twice, differently ({_described(seen[v.name])} and "
                f"{_described(v)}); give it once"
            )
    return list(seen.values())


def _described(v: Variant) -> str:
    methods = "/" + ",".join(v.methods) if v.methods is not None else ""
    if v.kind == "mla":
        return f"mla:{v.kv_lora_rank}+{v.rope_dim}{methods}"
    return f"gqa:{v.n_kv_heads}{methods}"


def methods_of(variant: Variant, methods: tuple[str, ...]) -> list[str]:
    methods = variant.methods if variant.methods is not None else methods
    if variant.kind != "mla":
        return list(methods)
    return list(dict.fromkeys("calib" if m in DATA_AWARE else "plain" for m in methods))


def checkpoint_id(src: Path) -> str:
    """What the source checkpoint is, without reading gigabytes: where it is, and all its files (``files_id``)."""
    return files_id(src, salt=str(src.resolve()))


def _texts(data: Path, eval_data: Path | None) -> tuple[dict[str, dict[str, Path | str]], str]:
    """The training and held-out text, each {file name: a file, or the text itself}, and its fingerprint. Without
    ``eval_data``: a tenth of the files of ``data`` held out whole (``attnlab.data.split_held_out``), or for a corpus
    of one file its last tenth of lines. The names are numbered in the files' order (a directory's files may share
    a name) and end in .txt, which the jobs' --data reads."""
    files = text_files(data)
    if eval_data is None and len(files) == 1:
        lines = read_text(files[0]).splitlines(keepends=True)
        cut = len(lines) - max(1, len(lines) // 10)
        if cut < 1:
            raise ValueError(
                f"--data {data}: one file of {len(lines)} line(s) has no tenth to hold out; pass --eval-data"
            )
        texts = {"train": {"0000.txt": "".join(lines[:cut])}, "heldout": {"0000.txt": "".join(lines[cut:])}}
        return texts, fingerprint(files, "the last tenth of the lines held out")
    if eval_data is not None:
        train, held = files, text_files(eval_data, "--eval-data")
    else:
        train, held = split_held_out(files, 0.1)

    def named(group: list[Path]) -> dict[str, Path | str]:
        return {f"{i:04d}-{f.stem if f.suffix == '.txt' else f.name}.txt": f for i, f in enumerate(group)}

    # where the training files end is part of the text: a file moved between the two is another sweep
    return {"train": named(train), "heldout": named(held)}, fingerprint(
        [*train, *held], f"{len(train)} to train"
    )


def _links_to(folder: Path, group: dict[str, Path | str]) -> bool:
    """Whether ``folder`` (made by an earlier sweep for a text of the same fingerprint) holds ``group``'s files as
    links to these very files. Equal text read from another place (a copy, since moved, deleted or edited) is not:
    its folder's links would read the other place."""
    if not folder.is_dir() or {p.name for p in folder.iterdir()} != set(group):
        return False
    for file_name, text in group.items():
        link = folder / file_name
        if isinstance(text, Path) and not (link.is_symlink() and link.readlink() == text.resolve()):
            return False
    return True


def _calibration_lines(texts: dict[str, dict[str, Path | str]]) -> Iterator[str]:
    """The training text's lines of seven words or more (stripped), file by file."""
    for text in texts["train"].values():
        for line in (read_text(text) if isinstance(text, Path) else text).splitlines():
            if len(line.split()) >= 7:
                yield line.strip()


Texts = tuple[dict[str, dict[str, Path | str]], str]  # what ``_texts`` returns: the text, and its fingerprint


def check_data(opts: SweepOptions, cfg: ModelConfig) -> Texts:
    """The text's faults that every job would meet, before anything is written (the sweep's --out included):
    paths that hold no text, training text without a line to calibrate on, held-out text shorter than one window
    (every loss was empty, with exit 0, and the message named the job cache's folder). Returns ``_texts``' answer,
    for ``prepare_data``: the files are listed and fingerprinted once."""
    texts, fp = _texts(opts.data, opts.eval_data)
    if next(_calibration_lines(texts), None) is None:  # the first such line is enough: reading stops there
        raise ValueError(
            f"--data {opts.data}: no line of seven words or more to calibrate the fit conversions"
        )
    tokenizer = load_tokenizer(opts.src, cfg.vocab_size)
    held = [read_text(t) if isinstance(t, Path) else t for t in texts["heldout"].values()]
    tokens = sum(len(tokenizer.encode(t, add_special_tokens=False).ids) for t in held if t) + len(held) - 1
    seq_len = _seq_len(opts, cfg)
    if tokens < seq_len + 1:
        what = (
            f"--eval-data {opts.eval_data}"
            if opts.eval_data is not None
            else f"the held-out part of --data {opts.data}"
        )
        raise ValueError(
            f"{what} has about {tokens} tokens: fewer than one window of --seq-len {seq_len} + 1"
        )
    return texts, fp


def prepare_data(data: Path, eval_data: Path | None, root: Path, read: Texts | None = None) -> dict:
    """The training and held-out text (``_texts``: files linked, a split file's parts written, into ``root``,
    attnlab's own cache), and calibration lines for the data-aware conversions: lines of seven words or more of the
    training text, shuffled with seed 0, 256 of them. ``read``: ``check_data``'s answer, not read again."""
    from ..atomic import remove_stale, temp_path, write_atomic

    texts, fp = _texts(data, eval_data) if read is None else read
    folders = {}
    for name, group in texts.items():
        folder = root / f"{name}-{fp}"
        remove_stale(folder)  # what a killed sweep left (it held root's lock: nothing else writes here)
        if not _links_to(folder, group):
            tmp = temp_path(folder, "tmp")
            tmp.mkdir()
            for file_name, text in group.items():
                if isinstance(text, Path):
                    (tmp / file_name).symlink_to(text.resolve())
                else:
                    (tmp / file_name).write_text(text)
            # the same text at another place: the links follow it (the sweep holds root's lock)
            if folder.is_dir():
                old = temp_path(folder, "del")
                folder.rename(old)
                shutil.rmtree(old)
            tmp.rename(folder)
        folders[name] = folder
    calib = root / f"calib-{fp}.txt"
    if not calib.is_file():
        lines = sorted(set(_calibration_lines(texts)))
        random.Random(0).shuffle(lines)
        if not lines:
            raise ValueError(
                f"--data {data}: no line of seven words or more to calibrate the fit conversions"
            )
        write_atomic(calib, "\n".join(lines[:256]) + "\n", ours=True)
    return {"train": folders["train"], "heldout": folders["heldout"], "calib": calib, "fingerprint": fp}


def device_args(opts: SweepOptions) -> dict:
    """``--device`` in the args of the jobs that run a model, only where it is not the CPU: a CPU sweep's jobs keep
    the hashes (and the cached results) they had before the option existed, and a GPU's results are other jobs."""
    where = resolve_device(opts.device)
    return {} if where.type == "cpu" else {"device": str(where)}


def eval_args(opts: SweepOptions, cfg: ModelConfig, data: dict) -> dict:
    """What every eval job scores on (its checkpoint aside): ``attnlab eval --data HELDOUT --seq-len T ...``."""
    return {"eval_data": str(data["heldout"]), "seq_len": _seq_len(opts, cfg), "eval_windows": _windows(opts),
            "data_id": data["fingerprint"], **device_args(opts)}  # fmt: skip


def uptrain_args(opts: SweepOptions, cfg: ModelConfig, data: dict, steps: int) -> dict:
    """A ``work.uptrain`` job's args for ``steps`` steps of the sweep's recipe (its source: the job it depends on,
    or an ``"src"`` added to these)."""
    teacher = {"src": str(opts.src.resolve()), "none": None}.get(opts.teacher, opts.teacher)
    if teacher is not None:
        teacher = str(Path(teacher).resolve())
    warmup = None if opts.warmup is None else round(opts.warmup * steps)  # 0: none, as uptrain --warmup 0
    return {"steps": steps, "batch_size": opts.batch_size, "seq_len": _seq_len(opts, cfg), "lr": opts.lr,
            "seed": opts.seed, "warmup": warmup, "distill_weight": opts.distill_weight,
            "temperature": opts.temperature, "eval_windows": _windows(opts), "data": str(data["train"]),
            "eval_data": str(data["heldout"]), "teacher": teacher,
            "teacher_id": checkpoint_id(Path(teacher)) if teacher else None, "save_every": max(50, steps // 4),
            "data_id": data["fingerprint"], **device_args(opts)}  # fmt: skip


def timing_args(opts: SweepOptions) -> dict:
    steps = opts.timing_steps or (8 if opts.quick else 16)
    repeats = opts.timing_repeats or (3 if opts.quick else 5)
    return {
        "context": opts.context,
        "batch": opts.batch,
        "steps": steps,
        "repeats": repeats,
        # what a timing runs on (work.speed sets it): a figure of its own, so part of its key
        "threads": opts.timing_threads or torch_threads(),
        **device_args(opts),
    }


def _seq_len(opts: SweepOptions, cfg: ModelConfig) -> int:
    return opts.seq_len or min(128 if opts.quick else 256, cfg.max_seq_len)


def _windows(opts: SweepOptions) -> int:
    return opts.eval_windows if opts.eval_windows is not None else (64 if opts.quick else 256)


def plan_jobs(
    opts: SweepOptions, cfg: ModelConfig, vs: list[Variant], data: dict
) -> tuple[list[Job], list[dict]]:
    """The jobs, and the rows (each naming the jobs that give its quality, bytes and speed: ``speed`` the job,
    ``speed_of`` the checkpoint's label in it when it times several)."""
    src = str(opts.src.resolve())
    src_id = checkpoint_id(opts.src)
    scored = eval_args(opts, cfg, data)
    timing = timing_args(opts)
    together = opts.timing == "together"
    jobs = [Job("eval/source", work.evaluate, {"ckpt": src, "src_id": src_id, **scored})]
    timed = {"source": src}  # label -> checkpoint path or the convert job that writes it
    rows = [{"variant": "source", "kind": "source", "method": "-", "steps": 0, "eval": "eval/source",
             "n_kv_heads": cfg.attention.n_kv_heads,
             "speed": "speed" if together else "speed/source", "speed_of": "source" if together else None,
             "convert": None, "checkpoint_job": None}]  # fmt: skip
    if not together:
        jobs.append(Job("speed/source", work.speed, {"ckpt": src, "src_id": src_id, **timing}, alone=True))
    for v in vs:
        speed = "speed" if together else f"speed/{v.name}"
        for m in methods_of(v, opts.methods):
            conv = f"convert/{v.name}/{m}"
            # the text only where the method reads it: a mean conversion (and the variant's timing, which
            # depends on it) ran again when the text changed
            reads = m in (*DATA_AWARE, "calib")
            args = {"src": src, "src_id": src_id, "kind": v.kind, "method": m,
                    "calib": str(data["calib"]) if reads else None,
                    "data_id": data["fingerprint"] if reads else None}  # fmt: skip
            if v.kind == "mla":
                args |= {"kv_lora_rank": v.kv_lora_rank, "rope_dim": v.rope_dim, **device_args(opts)}
            else:  # only the fit methods run the model
                args |= {"n_kv_heads": v.n_kv_heads, **(device_args(opts) if m in DATA_AWARE else {})}
            jobs.append(Job(conv, work.convert, args, output=True))
            if v.name not in timed:  # speed depends on the shapes only: one timing per variant
                timed[v.name] = conv
                if not together:
                    jobs.append(Job(speed, work.speed, {"ckpt": None, **timing}, deps=(conv,), alone=True))
            for s in opts.steps:
                row = {"variant": v.name, "kind": v.kind, "method": m, "steps": s, "speed": speed,
                       "speed_of": v.name if together else None, "convert": conv, "n_kv_heads": v.n_kv_heads,
                       "kv_lora_rank": v.kv_lora_rank, "rope_dim": v.rope_dim}  # fmt: skip
                if s == 0:
                    name = f"eval/{v.name}/{m}"
                    jobs.append(Job(name, work.evaluate, {"ckpt": None, **scored}, deps=(conv,)))
                    rows.append(row | {"eval": name, "checkpoint_job": conv})
                    continue
                name = f"uptrain/{v.name}/{m}/{s}"
                jobs.append(
                    Job(name, work.uptrain, uptrain_args(opts, cfg, data, s), deps=(conv,), output=True)
                )
                rows.append(row | {"eval": name, "checkpoint_job": name})
    if together:  # last, so that it runs when the jobs before it are done (it runs alone)
        deps = tuple(v for v in timed.values() if v != src)
        jobs.append(
            Job("speed", work.speed, {"ckpts": timed, "src_id": src_id, **timing}, deps=deps, alone=True)
        )
    return jobs, rows
