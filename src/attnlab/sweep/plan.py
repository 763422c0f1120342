"""What a sweep runs: its options, the variants (``--variants``), and the jobs (convert, uptrain, eval, speed) that
``attnlab.jobs.run_jobs`` caches and runs.

Variants: ``gqa:G,...`` (G divides the source's KV heads and is smaller; G = 1 is MQA), ``mla:R,...`` (the latent
rank; the rotary width is DeepSeek-V2's d_h / 2, ``attnlab.cost.sweep.mla_alternative``), or ``auto``: every GQA
group count that divides the source's KV heads down to MQA, and MLA at the ranks whose KV bytes per token equal
each GQA row's and the source's, so that rows compare at equal cache. ``--quick`` makes ``auto`` three variants:
the two smallest GQA group counts and MLA at the larger one's bytes.

Methods: GQA takes every ``attnlab convert --method``; MLA's conversion has no pooling method, only calibration
text or none, so for MLA a data-aware method (fit, grouped-fit) reads "calib" and any other "plain" (rows that
would be the same conversion are listed once).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

from ..config import AttentionConfig, ModelConfig
from ..convert.gqa import METHODS
from ..convert.model import DATA_AWARE
from ..cost.hardware import HARDWARE_NAMES
from ..cost.sweep import mla_alternative
from ..data import split_held_out, text_files
from ..jobs import Job
from . import work

KEEP = ("none", "best", "all")
DEFAULT_STEPS = (0, 50, 200)
QUICK_STEPS = (0, 50)


@dataclass(frozen=True)
class Variant:
    name: str  # "gqa-2", "mqa", "mla-28"; "source"
    kind: str  # "source", "gqa", "mla"
    n_kv_heads: int | None = None
    kv_lora_rank: int | None = None
    rope_dim: int | None = None


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

    @property
    def steps(self) -> tuple[int, ...]:
        if self.uptrain_steps is not None:
            return self.uptrain_steps
        return QUICK_STEPS if self.quick else DEFAULT_STEPS


def parse_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} takes a comma list of integers, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag} takes a comma list of integers, got {text!r}")
    return values


def check_options(opts: SweepOptions) -> None:
    """Refuse bad options before anything is loaded, naming the flag."""
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
    if not opts.lr > 0:
        raise ValueError(f"--lr must be > 0, got {opts.lr}")


def _gqa(g: int, n_kv: int) -> Variant:
    return Variant("mqa" if g == 1 else f"gqa-{g}", "gqa", n_kv_heads=g)


def _mla(cfg: ModelConfig, rank: int) -> Variant:
    rope = mla_alternative(cfg).qk_rope_head_dim
    return Variant(f"mla-{rank}", "mla", kv_lora_rank=rank, rope_dim=rope)


def variants(cfg: ModelConfig, spec: tuple[str, ...], quick: bool) -> list[Variant]:
    """The variants of ``--variants`` for a source of config ``cfg`` (see the module docstring)."""
    attn = cfg.attention
    if not isinstance(attn, AttentionConfig):
        raise ValueError("the sweep's source must be an MHA / GQA checkpoint (its attention is already MLA)")
    n_kv, hd = attn.n_kv_heads, attn.head_dim
    rope = mla_alternative(cfg).qk_rope_head_dim
    out: list[Variant] = []
    for part in spec:
        kind, _, values = part.partition(":")
        if kind == "auto" and not values:
            groups = [g for g in range(n_kv - 1, 0, -1) if n_kv % g == 0]
            if quick:  # an MQA source has no smaller GQA: MLA at its own bytes
                groups = groups[-2:]
                ranks = [2 * (groups or [n_kv])[0] * hd - rope]
            else:
                ranks = [2 * g * hd - rope for g in (n_kv, *groups)]
            out += [_gqa(g, n_kv) for g in groups] + [_mla(cfg, r) for r in ranks if r > 0]
        elif kind == "gqa" and values:
            for g in parse_ints(values, "--variants gqa:"):
                if not 1 <= g < n_kv or n_kv % g:
                    raise ValueError(
                        f"--variants gqa:{g}: the source has {n_kv} KV heads; choose a smaller number that divides it"
                    )
                out.append(_gqa(g, n_kv))
        elif kind == "mla" and values:
            for r in parse_ints(values, "--variants mla:"):
                if r < 1:
                    raise ValueError(f"--variants mla:{r}: a latent rank is >= 1")
                out.append(_mla(cfg, r))
        else:
            raise ValueError(f"--variants takes gqa:G,G,... mla:R,R,... or auto; got {part!r}")
    seen: dict[str, Variant] = {}
    for v in out:
        seen.setdefault(v.name, v)
    return list(seen.values())


def methods_of(variant: Variant, methods: tuple[str, ...]) -> list[str]:
    if variant.kind != "mla":
        return list(methods)
    return list(dict.fromkeys("calib" if m in DATA_AWARE else "plain" for m in methods))


def fingerprint(paths: list[Path]) -> str:
    """What the data is: every file's name and bytes."""
    h = hashlib.sha256()
    for p in paths:
        h.update(str(p.name).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def checkpoint_id(src: Path) -> str:
    """What the source checkpoint is, without reading gigabytes: its files' names, sizes and modification times."""
    h = hashlib.sha256(str(src.resolve()).encode())
    for p in sorted(src.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:16]


def prepare_data(opts: SweepOptions, root: Path) -> dict:
    """The training and held-out files (linked into ``root``, attnlab's own cache), and calibration lines for the
    data-aware conversions: lines of seven words or more of the training text, shuffled with seed 0, 256 of them."""
    from ..atomic import write_atomic

    files = text_files(opts.data)
    if opts.eval_data is not None:
        train, held = files, text_files(opts.eval_data, "--eval-data")
    else:
        train, held = split_held_out(files, 0.1)
    fp = fingerprint([*train, *held])
    folders = {}
    for name, group in (("train", train), ("heldout", held)):
        folder = root / f"{name}-{fp}"
        if not folder.is_dir():
            tmp = root / f".{folder.name}.tmp-{random.getrandbits(32):08x}"
            tmp.mkdir()
            for f in group:
                (tmp / f.name).symlink_to(f.resolve())
            tmp.rename(folder)
        folders[name] = folder
    calib = root / f"calib-{fp}.txt"
    if not calib.is_file():
        lines = sorted(
            {ln.strip() for f in train for ln in f.read_text().splitlines() if len(ln.split()) >= 7}
        )
        random.Random(0).shuffle(lines)
        if not lines:
            raise ValueError(
                f"--data {opts.data}: no line of seven words or more to calibrate the fit conversions"
            )
        write_atomic(calib, "\n".join(lines[:256]) + "\n", ours=True)
    return {"train": folders["train"], "heldout": folders["heldout"], "calib": calib, "fingerprint": fp}


def plan_jobs(
    opts: SweepOptions, cfg: ModelConfig, vs: list[Variant], data: dict
) -> tuple[list[Job], list[dict]]:
    """The jobs, and the rows (each naming the jobs that give its quality, bytes and speed)."""
    src = str(opts.src.resolve())
    src_id = checkpoint_id(opts.src)
    seq_len = opts.seq_len or min(128 if opts.quick else 256, cfg.max_seq_len)
    windows = opts.eval_windows if opts.eval_windows is not None else (64 if opts.quick else 256)
    scored = {"eval_data": str(data["heldout"]), "seq_len": seq_len, "eval_windows": windows,
              "data_id": data["fingerprint"]}  # fmt: skip
    timing = {"context": opts.context, "batch": opts.batch, "steps": 8 if opts.quick else 16,
              "repeats": 3 if opts.quick else 5}  # fmt: skip
    teacher = {"src": src, "none": None}.get(opts.teacher, opts.teacher)
    if teacher is not None and teacher != src:
        teacher = str(Path(teacher).resolve())
    jobs = [
        Job("eval/source", work.evaluate, {"ckpt": src, "src_id": src_id, **scored}),
        Job("speed/source", work.speed, {"ckpt": src, "src_id": src_id, **timing}, alone=True),
    ]
    rows = [{"variant": "source", "kind": "source", "method": "-", "steps": 0, "eval": "eval/source",
             "speed": "speed/source", "convert": None, "checkpoint_job": None}]  # fmt: skip
    for v in vs:
        speed_added = False
        for m in methods_of(v, opts.methods):
            conv = f"convert/{v.name}/{m}"
            args = {"src": src, "src_id": src_id, "kind": v.kind, "method": m, "calib": str(data["calib"]),
                    "data_id": data["fingerprint"] if m in (*DATA_AWARE, "calib") else None}  # fmt: skip
            if v.kind == "mla":
                args |= {"kv_lora_rank": v.kv_lora_rank, "rope_dim": v.rope_dim}
            else:
                args |= {"n_kv_heads": v.n_kv_heads}
            jobs.append(Job(conv, work.convert, args, output=True))
            if not speed_added:  # speed depends on the shapes only: one timing per variant
                jobs.append(
                    Job(f"speed/{v.name}", work.speed, {"ckpt": None, **timing}, deps=(conv,), alone=True)
                )
                speed_added = True
            for s in opts.steps:
                row = {"variant": v.name, "kind": v.kind, "method": m, "steps": s, "speed": f"speed/{v.name}",
                       "convert": conv, "n_kv_heads": v.n_kv_heads, "kv_lora_rank": v.kv_lora_rank,
                       "rope_dim": v.rope_dim}  # fmt: skip
                if s == 0:
                    name = f"eval/{v.name}/{m}"
                    jobs.append(Job(name, work.evaluate, {"ckpt": None, **scored}, deps=(conv,)))
                    rows.append(row | {"eval": name, "checkpoint_job": conv})
                    continue
                name = f"uptrain/{v.name}/{m}/{s}"
                up = {"steps": s, "batch_size": opts.batch_size, "seq_len": seq_len, "lr": opts.lr, "seed": 0,
                      "eval_windows": windows, "data": str(data["train"]), "eval_data": str(data["heldout"]),
                      "teacher": teacher, "teacher_id": checkpoint_id(Path(teacher)) if teacher else None,
                      "save_every": max(50, s // 4), "data_id": data["fingerprint"]}  # fmt: skip
                jobs.append(Job(name, work.uptrain, up, deps=(conv,), output=True))
                rows.append(row | {"eval": name, "checkpoint_job": name})
    return jobs, rows
