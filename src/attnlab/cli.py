"""The ``attnlab`` command: a thin layer over the library.

Every subcommand prints a table by default and JSON with ``--json``. User errors (bad presets, configs,
sizes, files, a full disk, a missing package) exit with code 2 and one line on stderr, never a traceback:
wrap every command in ``user_errors``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
import typer.core

try:  # typer >= 0.20 carries its own copy of click
    from typer._click import exceptions as _usage
except ImportError:
    from click import exceptions as _usage


class _Group(typer.core.TyperGroup):
    """The ``attnlab`` groups: flags (``--json``, ``--overwrite``, ``--help``) show no ``<bool>`` value in help, and
    usage errors (an unknown option, ``--kv-heads x``) are one stderr line with exit code 2 like every other user
    error, not a boxed panel."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        if empty := self._empty_value(self._argv(args, kwargs)):
            print(f"attnlab: error: {empty} (see '{self._named(args, kwargs)} --help')", file=sys.stderr)
            sys.exit(2)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)  # Exit(n) comes back as n
        except SystemExit as err:  # SIGTERM (_terminate): said as Ctrl-C is
            if err.code == 128 + signal.SIGTERM:
                self._interrupted(args, kwargs, "terminated")
            raise
        except _usage.NoArgsIsHelpError as err:
            err.show()  # the help text itself
            sys.exit(err.exit_code)
        except _usage.ClickException as err:
            where = getattr(getattr(err, "ctx", None), "command_path", None) or self._named(args, kwargs)
            message = " ".join(err.format_message().split())
            print(f"attnlab: error: {message} (see '{where} --help')", file=sys.stderr)
            sys.exit(err.exit_code)
        except typer.Abort:
            print("attnlab: aborted", file=sys.stderr)
            sys.exit(1)
        # Ctrl-C, which Typer turns into exit code 130 (as a shell reports it): one line, not silence
        if code == 130:
            self._interrupted(args, kwargs, "interrupted")
        sys.exit(code if isinstance(code, int) else 0)

    def _interrupted(self, args: tuple, kwargs: dict, how: str) -> None:
        uptrain = self._named(args, kwargs) == "attnlab uptrain"
        resume = "; rerun it with --resume to continue" if uptrain else ""
        print(f"attnlab: {how} (nothing half-written is left){resume}", file=sys.stderr)

    def _named(self, args: tuple, kwargs: dict) -> str:
        """The command a usage error without a context belongs to (``compare --json=1``: the parser's own error),
        from the words before the first option: "attnlab compare", "attnlab bench decode"."""
        return " ".join(["attnlab", *self._command(self._argv(args, kwargs))[0]])

    def _command(self, argv: list[str]) -> tuple[list[str], Any]:
        """The command words at the start of ``argv`` and the command (or group) they name."""
        path, group = [], self
        for word in argv:
            command = group.commands.get(word) if isinstance(group, typer.core.TyperGroup) else None
            if command is None:
                break
            path.append(word)
            group = command
        return path, group

    def _empty_value(self, argv: list[str]) -> str | None:
        """What is wrong with an empty value on the command line, if one is there (None if not). No option or
        argument of attnlab takes one, and an empty path is the current directory to pathlib: ``--data "$UNSET"``
        read every .txt file under it, ``--method ''`` meant the default. Words are read as the command's parser
        reads them: an option's value may be anything (``--prompt '--help='``, ``--stop '='``)."""
        path, command = self._command(argv)
        takes_value = {
            name for p in getattr(command, "params", []) if not getattr(p, "is_flag", True) for name in p.opts
        }
        words = iter(argv[len(path) :])
        for word in words:
            name, eq, value = word.partition("=")
            if word == "--":  # what follows is arguments, whatever they look like
                return "an argument is '' (empty)" if "" in words else None
            if word in takes_value:
                value = next(words, None)
                if value == "":
                    return f"{word} '' is empty"
            elif eq and name in takes_value and value == "":
                return f"{name} '' is empty"
            elif word == "":
                return "an argument is '' (empty)"
        return None

    @staticmethod
    def _argv(args: tuple, kwargs: dict) -> list[str]:
        return list(kwargs.get("args") or (args[0] if args else None) or sys.argv[1:])

    def get_params(self, ctx: Any) -> list[Any]:
        return _without_flag_metavars(super().get_params(ctx))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None and not isinstance(command, typer.core.TyperGroup):
            _without_flag_metavars(command.get_params(ctx))
        return command


def _without_flag_metavars(params: list[Any]) -> list[Any]:
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""  # a flag takes no value; typer would show its type as "<bool>"
    return params


app = typer.Typer(
    name="attnlab",
    help="MHA, MQA, GQA and MLA: what they cost, how fast they decode, and converting checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=_Group,
)


def _version() -> str:
    try:
        return importlib.metadata.version("attnlab")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was not installed
        return sys.modules[__package__].__version__


def _show_version(value: bool) -> None:
    if value:
        print(f"attnlab {_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print attnlab's version and exit.", is_eager=True, callback=_show_version
    ),
) -> None:
    """MHA, MQA, GQA and MLA: what they cost, how fast they decode, and converting checkpoints."""


def _missing_package(err: ImportError) -> str:
    """The one line for a missing package: which one, and the exact ``pip install`` that adds it."""
    found = re.search(r"No module named '([^']+)'", str(err))
    module = (err.name or (found.group(1) if found else "")).split(".")[0]
    if not module:
        return f"a package this command needs cannot be imported: {err}"
    requirement = module.replace("_", "-")
    try:  # the version range attnlab declares for it, when it is one of attnlab's dependencies
        for spec in importlib.metadata.requires("attnlab") or []:
            if re.match(rf"{re.escape(requirement)}\b", spec, re.IGNORECASE) and "extra ==" not in spec:
                requirement = spec.split(";")[0].strip()
    except importlib.metadata.PackageNotFoundError:
        pass
    return f"this command needs the Python package {module!r}, which is not installed: pip install '{requirement}'"


def _message(err: BaseException) -> str:
    if isinstance(err, KeyError) and err.args:
        return str(err.args[0])
    if isinstance(err, ImportError):
        return _missing_package(err)
    if isinstance(err, OSError) and err.strerror:  # from the OS: say what failed, on which path
        where = f"{err.filename}: " if err.filename else ""
        return f"{where}{err.strerror}"
    if isinstance(err, (MemoryError, RuntimeError)):
        return f"out of memory: {err} (try smaller sizes)"
    return str(err)


def _is_allocation_failure(err: RuntimeError) -> bool:
    """torch's failure to allocate a tensor (CPU allocator, CUDA out of memory): a size the user chose."""
    return type(err).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(err)


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn the errors a user can cause into one stderr line and exit code 2: bad values and files
    (ValueError, TypeError, KeyError), the filesystem (every OSError: missing, exists, disk full, permission,
    busy), memory (sizes that cannot be allocated) and missing packages (with the pip line that installs them).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError, KeyError, OSError, MemoryError) as err:
            _fail(err)
        except ImportError as err:
            if (err.name or "").startswith("attnlab"):  # our own module missing: a bug, not the install
                raise
            _fail(err)
        except RuntimeError as err:
            if not _is_allocation_failure(err):
                raise
            _fail(err)

    return wrapper


# Errors that come from what the user gave (options, files, the checkpoint): under torchrun every rank meets them
# alike, before or at the same collective, so rank 0 reports them (another rank only if it outlives a wait: the
# error was its own). Other failures (a full disk, memory) may be one rank's own and are reported by that rank, named.
_SAME_ON_EVERY_RANK = (ValueError, TypeError, KeyError, FileNotFoundError, FileExistsError)


def _fail(err: BaseException) -> None:
    message = " ".join(_message(err).split())  # one line, whatever the exception's text holds
    rank = os.environ.get("RANK", "0") if "WORLD_SIZE" in os.environ else "0"
    if rank == "0":
        print(f"attnlab: error: {message}", file=sys.stderr, flush=True)
    elif not isinstance(err, _SAME_ON_EVERY_RANK):
        print(f"attnlab: error (rank {rank}): {message}", file=sys.stderr)
    else:
        # Rank 0 reports it. Leaving at once, this rank could make torchrun stop rank 0 before its line is out (seen
        # on a loaded machine); torchrun stops this rank as soon as rank 0 exits, so waiting costs nothing. Still
        # running after the wait, it met the error alone (a file missing on its machine, say): it says so itself.
        try:
            time.sleep(_QUIET_RANK_WAIT_S)
        except SystemExit:  # torchrun's SIGTERM once rank 0 has said it: nothing to add, no "--resume" advice
            raise typer.Exit(code=2) from None
        print(f"attnlab: error (rank {rank}): {message}", file=sys.stderr, flush=True)
    raise typer.Exit(code=2) from None


_QUIET_RANK_WAIT_S = 10.0


def _device_option(before: str = "", after: str = ".") -> Any:
    """``--device``, the same on every command that computes with a model (``resources.resolve_device`` reads it)."""
    values = "auto (CUDA when present, else the CPU), cpu, cuda or cuda:N; said on stderr"
    return typer.Option("auto", "--device", help=before + values + after)


@app.command()
@user_errors
def compare(
    model: str = typer.Option("llama-2-7b", "--model", help="Preset name (exact) or path to a config.json."),
    seq_len: int = typer.Option(4096, "--seq-len", help="Tokens per sequence (context length)."),
    batch: int = typer.Option(1, "--batch", help="Sequences decoded together."),
    dtype: str = typer.Option("bf16", "--dtype", help="Weights and KV dtype: fp32, bf16, fp16, fp8, ..."),
    hardware: str = typer.Option("h100", "--hardware", help="h100, h200, a100-80gb, l40s, rtx4090 or local."),
    tp: int = typer.Option(
        1, "--tp", help="Tensor-parallel GPUs splitting every layer by heads: per-GPU figures."
    ),
    devices: int | None = typer.Option(None, "--devices", help="Another name for --tp (what it was called)."),
    plot: Path | None = typer.Option(None, "--plot", help="Write KV cache and latency plots to this PNG."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
    measure: bool = typer.Option(False, "--measure", help="Also time one layer per variant on this machine."),
) -> None:
    """What MHA, every GQA, MQA and MLA would cost for a model: KV cache, FLOPs, decode latency, max batch."""
    from .bench.compare import run_compare

    run_compare(
        model=model, seq_len=seq_len, batch=batch, dtype=dtype, hardware=hardware, tp=tp, devices=devices,
        plot=plot, as_json=as_json, measure=measure,
    )  # fmt: skip


@app.command()
@user_errors
def convert(
    src: Path = typer.Argument(..., help="Source checkpoint directory (config.json + safetensors)."),
    dst: Path = typer.Argument(..., help="Destination directory (written atomically; must not exist)."),
    to: str = typer.Option(
        "gqa", "--to", help="gqa: fewer KV heads, same architecture; mla: DeepSeek-V3 MLA."
    ),
    kv_heads: int | None = typer.Option(
        None, "--kv-heads", help="gqa: KV heads after; divides the source's."
    ),
    method: str | None = typer.Option(
        None, "--method", help="gqa: mean (default), first, random, fit, grouped-fit (+ --calib)."
    ),
    kv_lora_rank: int | None = typer.Option(
        None, "--kv-lora-rank", help="mla: latent values cached per token and layer."
    ),
    rope_dim: int | None = typer.Option(
        None,
        "--rope-dim",
        help="mla: rotary key width, even, <= the dims RoPE turns (default all of them: head_dim, or the rotary "
        "part of a partial rotary; with llama3 / yarn RoPE, the planes they leave unscaled).",
    ),
    planes: str | None = typer.Option(
        None, "--planes", help="mla: planes kept rotary: norm (default), error, first, uniform, or a stride."
    ),
    calib: Path | None = typer.Option(
        None, "--calib", help="Calibration text file (gqa: for fit / grouped-fit; mla: recommended)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing destination."),
    device: str = _device_option("Where --method fit / grouped-fit and --to mla run the model: "),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
) -> None:
    """Convert a checkpoint to fewer KV heads (GQA / MQA, same architecture), or to a native DeepSeek-V3 MLA
    checkpoint (--to mla); `attnlab families` says which families take which."""
    from .hf.command import run_convert

    run_convert(
        src, dst, to=to, kv_heads=kv_heads, method=method, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
        planes=planes, calib=calib, overwrite=overwrite, as_json=as_json, device=device,
    )  # fmt: skip


@app.command()
@user_errors
def uptrain(
    src: Path = typer.Argument(
        ..., help="Causal-LM checkpoint to train (a family of `attnlab families`); never modified."
    ),
    dst: Path = typer.Argument(
        ..., help="Output checkpoint, like SRC; appears (atomically) when the run ends."
    ),
    data: Path = typer.Option(..., "--data", help="A text file or a directory of .txt files."),
    eval_data: Path | None = typer.Option(
        None, "--eval-data", help="Held-out text; default: whole files of --data (--held-out of them)."
    ),
    held_out: float = typer.Option(
        0.1,
        "--held-out",
        help="Fraction of --data's files held out (rounded, at least one of two or more; 0: none).",
    ),
    steps: int = typer.Option(1000, "--steps", help="Optimizer steps."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per rank per micro-step."),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per sequence (<= max_position_embeddings)."),
    lr: float = typer.Option(3e-4, "--lr", help="Peak learning rate (AdamW)."),
    min_lr: float = typer.Option(0.1, "--min-lr", help="Final learning rate as a fraction of --lr."),
    warmup: int | None = typer.Option(None, "--warmup", help="Linear warmup steps (default 5% of --steps)."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-steps per optimizer step."),
    weight_decay: float = typer.Option(0.1, "--weight-decay", help="AdamW weight decay (matrices only)."),
    grad_clip: float = typer.Option(1.0, "--grad-clip", help="Gradient norm clip (0: none)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the data order (and of torch)."),
    save_every: int = typer.Option(100, "--save-every", help="Checkpoint every N steps (0: never)."),
    keep: int = typer.Option(3, "--keep", help="Checkpoints kept in the run directory."),
    eval_every: int = typer.Option(0, "--eval-every", help="Evaluate every N steps (0: at the end only)."),
    eval_windows: int = typer.Option(0, "--eval-windows", help="Held-out windows scored (0: all)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the run directory's last checkpoint."),
    teacher: Path | None = typer.Option(
        None, "--teacher", help="Checkpoint to distil from (same vocabulary)."
    ),
    distill_weight: float = typer.Option(0.5, "--distill-weight", help="Weight of the KL term, in [0, 1]."),
    temperature: float = typer.Option(2.0, "--temperature", help="Distillation temperature, in [0.01, 100]."),
    train: str = typer.Option("all", "--train", help="What is trained: all or attention."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, or bf16 autocast (fp32 master weights)."),
    fsdp: bool = typer.Option(False, "--fsdp", help="Shard with FSDP2 (under torchrun) instead of DDP."),
    device: str = _device_option(after=" (torchrun: cuda is cuda:LOCAL_RANK on each rank, NCCL)."),
    tp: int = typer.Option(
        1,
        "--tp",
        help="Split each layer's heads over N ranks (torchrun); data parallel over the rest (FSDP2).",
    ),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Checkpoints and log until DST is written."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace DST / start the run directory over."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Uptrain a (converted) checkpoint on text: AdamW, warmup + cosine, checkpoints and exact --resume.

    Runs as is on one process, or under `torchrun --nproc-per-node N -m attnlab uptrain ...` (DDP, --fsdp, --tp).
    """
    from .train.command import run_uptrain
    from .train.options import UptrainOptions

    opts = UptrainOptions(
        src=src, dst=dst, data=data, eval_data=eval_data, held_out=held_out, steps=steps, batch_size=batch_size,
        seq_len=seq_len, lr=lr, min_lr=min_lr, warmup=warmup, grad_accum=grad_accum, weight_decay=weight_decay,
        grad_clip=grad_clip, seed=seed, save_every=save_every, keep=keep, eval_every=eval_every,
        eval_windows=eval_windows, resume=resume, teacher=teacher, distill_weight=distill_weight,
        temperature=temperature, train=train, dtype=dtype, fsdp=fsdp, tp=tp, overwrite=overwrite, run_dir=run_dir,
        device=device,
    )  # fmt: skip
    run_uptrain(opts, as_json=as_json)


@app.command("eval")
@user_errors
def eval_(
    ckpt: Path = typer.Argument(..., help="Causal-LM checkpoint directory (with its tokenizer.json)."),
    data: Path = typer.Option(
        ...,
        "--data",
        help="A text file or a directory of .txt files (every whole window scored; the last tokens, short of a "
        "window of --seq-len, are not).",
    ),
    seq_len: int | None = typer.Option(
        None, "--seq-len", help="Window length (default min(1024, max positions))."
    ),
    batch_size: int = typer.Option(8, "--batch-size", help="Windows per forward pass."),
    max_windows: int = typer.Option(
        0, "--max-windows", help="Score this many windows spread evenly (0: all)."
    ),
    device: str = _device_option(),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
) -> None:
    """Loss, perplexity and bits per byte of a checkpoint on a text (the same function uptrain uses)."""
    from .train.command import run_eval

    run_eval(
        ckpt, data, seq_len=seq_len, batch_size=batch_size, max_windows=max_windows, as_json=as_json, device=device,
    )  # fmt: skip


@app.command()
@user_errors
def generate(
    ckpt: Path = typer.Argument(..., help="Causal-LM checkpoint directory (with its tokenizer.json)."),
    prompt: list[str] = typer.Option(..., "--prompt", help="Prompt text; repeat for a batch of prompts."),
    max_new: int = typer.Option(64, "--max-new", help="New tokens per prompt at most."),
    temperature: float = typer.Option(
        0.0, "--temperature", help="0: greedy; else sample at this temperature."
    ),
    top_k: int | None = typer.Option(None, "--top-k", help="Sample among the k likeliest tokens."),
    top_p: float | None = typer.Option(None, "--top-p", help="Sample among the likeliest tokens of mass p."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampling."),
    stop: list[str] = typer.Option([], "--stop", help="A token that ends a prompt's output (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Do not stop at the checkpoint's eos token."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (the checkpoint's), fp32 or bf16."),
    bandwidth: float | None = typer.Option(
        None, "--bandwidth", help="Memory bandwidth in GB/s for the roofline (default: measured here)."
    ),
    device: str = _device_option(),
    cache: str = typer.Option(
        "auto", "--cache", help="auto, contiguous, paged or static (fixed shapes, for --compile)."
    ),
    compile_step: bool = typer.Option(
        False, "--compile", help="Compile the decode step once (static cache; CUDA graphs on a GPU)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the tables."),
) -> None:
    """Generate text from a checkpoint: prefill scores the last position only; prints tokens/s, prefill and
    decode time, and the decode phase's fraction of the bandwidth roofline."""
    from .bench.generate import run_generate

    run_generate(
        ckpt, prompt, max_new=max_new, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
        ignore_eos=ignore_eos, dtype=dtype, as_json=as_json, bandwidth_gbs=bandwidth, device=device, cache=cache,
        compile_step=compile_step,
    )  # fmt: skip


@app.command()
@user_errors
def sweep(
    src: Path = typer.Argument(..., help="Source causal-LM checkpoint (MHA or GQA); never modified."),
    more_variants: list[str] | None = typer.Argument(
        None,
        metavar="variants",  # typer's usage line: "[variants]..." (with "" it was "[]...")
        show_default=False,
        help="More --variants: --variants gqa:4,2 mla:256,128 reads both.",
    ),
    data: Path = typer.Option(..., "--data", help="Text for uptraining and calibration (file or directory)."),
    eval_data: Path | None = typer.Option(
        None,
        "--eval-data",
        help="Held-out text; default: a tenth of --data (its files, or one file's lines).",
    ),
    variants: list[str] = typer.Option(
        ["auto"], "--variants", help="gqa:G,G,... mla:R,R,... or auto (repeatable, or space separated)."
    ),
    methods: str = typer.Option(
        "mean,fit", "--methods", help="Conversion methods (attnlab convert --method)."
    ),
    uptrain_steps: str | None = typer.Option(
        None, "--uptrain-steps", help="Comma list of uptraining steps (default 0,50,200; --quick 0,50)."
    ),
    teacher: str = typer.Option(
        "src", "--teacher", help="Distil from: src (the source), none, or a checkpoint."
    ),
    context: int = typer.Option(4096, "--context", help="Tokens per request: KV bytes, roofline, timing."),
    batch: int = typer.Option(1, "--batch", help="Requests decoded together."),
    hardware: list[str] = typer.Option(["h100"], "--hardware", help="Roofline device(s) (repeatable)."),
    jobs: int = typer.Option(1, "--jobs", help="Worker processes; the threads are split between them."),
    out: Path | None = typer.Option(
        None, "--out", help="Directory for the job cache, checkpoints, JSON, report."
    ),
    keep: str = typer.Option("all", "--keep", help="Checkpoints kept: none, best (Pareto-optimal) or all."),
    seq_len: int | None = typer.Option(None, "--seq-len", help="Uptraining / eval window (default <= 256)."),
    batch_size: int = typer.Option(8, "--batch-size", help="Uptraining sequences per step."),
    lr: float = typer.Option(3e-4, "--lr", help="Uptraining peak learning rate."),
    eval_windows: int | None = typer.Option(
        None, "--eval-windows", help="Held-out windows scored (default 256; --quick 64; 0: all)."
    ),
    seed: int = typer.Option(0, "--seed", help="Uptraining seed (data order)."),
    warmup: float | None = typer.Option(
        None, "--warmup", help="Uptraining warmup, a fraction of its steps (default: uptrain's 5 %)."
    ),
    distill_weight: float = typer.Option(0.5, "--distill-weight", help="Weight of the KL to the teacher."),
    temperature: float = typer.Option(2.0, "--temperature", help="Distillation temperature."),
    timing: str = typer.Option(
        "each", "--timing", help="each: a cached timing per variant; together: all in turn in one job."
    ),
    quick: bool = typer.Option(False, "--quick", help="Three variants, steps 0,50, fewer windows: minutes."),
    device: str = _device_option(),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
) -> None:
    """Which attention should this model use? Every variant x method x uptraining steps: held-out loss, KV bytes,
    decode tokens/s here and the roofline; Pareto-optimal rows marked."""
    from .sweep import SweepOptions, run_sweep
    from .sweep.plan import parse_ints

    for extra in more_variants or []:
        if extra.partition(":")[0] not in ("gqa", "mla", "auto"):
            raise ValueError(f"unexpected argument {extra!r}: sweep takes one SRC (and gqa:/mla: variants)")
    opts = SweepOptions(
        src=src, data=data, eval_data=eval_data,
        variants=tuple(p for v in [*variants, *(more_variants or [])] for p in v.split()),
        methods=tuple(m.strip() for m in methods.split(",")),  # (an empty one is refused, not dropped)
        uptrain_steps=parse_ints(uptrain_steps, "--uptrain-steps") if uptrain_steps is not None else None,
        teacher=teacher, context=context, batch=batch, hardware=tuple(hardware), jobs=jobs, out=out, quick=quick,
        keep=keep, seq_len=seq_len, batch_size=batch_size, lr=lr, eval_windows=eval_windows, seed=seed, warmup=warmup,
        distill_weight=distill_weight, temperature=temperature, timing=timing, device=device,
    )  # fmt: skip
    run_sweep(opts, as_json=as_json)


@app.command()
@user_errors
def families(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
    markdown: bool = typer.Option(
        False, "--markdown", help="Print docs/families.md (the table and its notes)."
    ),
) -> None:
    """The model families attnlab reads, and what each command does with them (import, convert, uptrain, ...)."""
    from .bench import families as support
    from .console import Grid, print_grid

    if as_json and markdown:
        raise ValueError("--json and --markdown: choose one")
    if as_json or markdown:
        print(support.as_json() if as_json else support.markdown(), end="\n" if as_json else "")
        return
    grid = Grid(
        "Model families (attnlab families --markdown: with the notes behind each cell)",
        ["family", *support.COLUMNS],
    )
    for fam, cells in support.rows():
        grid.add_row(fam.name, *(cells[col].text for col in support.COLUMNS))
    print_grid(grid)


bench_app = typer.Typer(
    help="Time decode steps against baselines and the roofline.", no_args_is_help=True, cls=_Group
)
app.add_typer(bench_app, name="bench")


@bench_app.command("decode")
@user_errors
def bench_decode(
    kv_heads: str = typer.Option("32,8,1", "--kv-heads", help="Comma list of n_kv_heads (of 32)."),
    batch: str = typer.Option("1", "--batch", help="Comma list of batch sizes."),
    context: str = typer.Option("2048", "--context", help="Comma list of live context lengths."),
    dtype: str = typer.Option("fp32", "--dtype", help="Comma list of fp32, bf16."),
    repeats: int = typer.Option(5, "--repeats", help="Timed round-robin repeats (median kept)."),
    layer: bool = typer.Option(
        True, "--layer/--no-layer", help="Whole layer vs HF LlamaAttention (at the first --batch)."
    ),
    mla: bool = typer.Option(
        True, "--mla/--no-mla", help="MLA naive/absorbed vs HF DeepseekV3 (at the first --batch)."
    ),
    paged: bool = typer.Option(
        True, "--paged/--no-paged", help="Paged vs contiguous cache (for --kv-heads of 8 or fewer)."
    ),
    e2e: bool = typer.Option(
        False,
        "--e2e",
        help="Also time generation of a small model per variant (4 layers of d_model 1024, at the smallest "
        "--context; a ragged batch of 4 at 1, 3/4, 1/2 and 1/4 of it).",
    ),
    plot: Path | None = typer.Option(None, "--plot", help="Write latency vs n_kv_heads to this PNG."),
    cached_hardware: bool = typer.Option(
        False,
        "--cached-hardware",
        help="Reuse this boot's bandwidth/peak measurement instead of measuring now.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the tables."),
) -> None:
    """One decode step with a filled cache: ms, GB/s, fraction of the roofline, speedups over the baselines.

    Leave OMP_WAIT_POLICY unset: with PASSIVE every fused kernel call must wake sleeping OpenMP workers
    (a whole decode step measured ~1.6x slower; see benchmarks/decode.py).
    """
    from .bench.command import run_bench_decode

    run_bench_decode(
        kv_heads=kv_heads, batch=batch, context=context, dtype=dtype, repeats=repeats, layer=layer, mla=mla,
        paged=paged, e2e=e2e, plot=plot, as_json=as_json, cached_hardware=cached_hardware,
    )  # fmt: skip


def _terminate(signum: int, _frame: Any) -> None:
    # SIGTERM (kill, timeout, a job scheduler) unwinds like Ctrl-C, so an atomic write removes its temporary.
    raise SystemExit(128 + signum)


def main() -> None:
    from .resources import die_with_launcher

    die_with_launcher()  # a rank of torchrun's, as early as the imports allow (again in distributed.setup)
    signal.signal(signal.SIGTERM, _terminate)
    app()
