"""The fused CPU kernels (``csrc/``) as PyTorch operators, built at first use; the PyTorch kernels are the fallback.

Decode attention: one query per head over a contiguous or paged cache in a single pass: per (batch row, KV head),
the group's queries are scored against each block of cached keys, an online softmax updates a running maximum and
exp-sum, and the block's values are accumulated, so every cached byte is read once (GQA, MQA and MLA's absorbed
form, whose values are the first columns of its key rows). Paged batches are attended together, in one call. See
``csrc/decode.h`` for the algorithm. The same library holds the few-row matrix-vector product of decode-time
linear layers (``linear``) and a decoder block's whole decode step (``BlockStep``, used by
``attnlab.model.Block``).

Operators. Each kernel is a PyTorch operator, ``torch.ops.attnlab.<name>``: ``decode``, ``mla_decode``,
``static_decode``, ``paged_decode``, ``linear``, ``block_step`` (and ``amx``, the AMX switch). Their schemas, fake
implementations (shapes and dtypes, for ``torch.compile`` and meta tensors) and FLOP formulas
(``torch.utils.flop_counter``) are defined below when this module is imported, whether or not the kernels can be
built, so that a ``FlopCounterMode`` opened before the first call counts them too; the build adds their CPU
implementations (``csrc/ops.cpp``), which read each argument by its name (their list of names is checked against
these schemas when the library loads). So
the flop counter, ``torch.profiler`` (each op by name) and ``torch.compile`` (the ops in the graph) see them as
any PyTorch op. They are registered in C++, through LibTorch's stable ABI (its headers compile in about a second,
``torch/library.h``'s in five), and called through their ``OpOverload``s: a call costs one pass through the
dispatcher, where a ``torch.library.custom_op`` around a Python function would add a Python-level wrapper and a
second trip into Python per call.

Building: the first call compiles ``csrc/`` with ``torch.utils.cpp_extension.load`` (g++ with OpenMP, ``-O3
-march=native``) in two units built in parallel: ``kernels.cpp`` (the kernels, one header per concern, no PyTorch
header) and ``ops.cpp`` (the operators, on the stable ABI of PyTorch 2.13 or later, whose stable library turns a
kernel's refusal into a Python error: built against torch 2.11 on a GPU machine, with 2.13's error macro
supplied, a refused operand killed the process; an older PyTorch takes the PyTorch kernels, saying why). The build lands in PyTorch's
extension cache (``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``) under a name that hashes
everything the generated build file depends on (``build_inputs``): the sources and their directory, the flags, the
compiler, the Python environment and the PyTorch installation whose headers it names, and the CPU model. So a
build is reused by later processes of the same environment on the same machine, and two environments (two virtual
environments, two checkouts) keep one build each rather than rebuilding each other's in turn. A build (not a load
from the cache) says so on stderr before it starts, once. Commands that time something call ``ensure_built``
before starting a clock. On CPUs with AMX tiles (Intel Sapphire Rapids and later), bfloat16 steps whose groups
have 8 or more queries run on the tile unit (``csrc/amx.h`` says how); on CPUs without tiles but with AVX512-BF16
(AMD Zen 4 and later) they run in the same layouts on its dot products. ``amx()`` and ``bf16_dots()`` say which
does, ``use_amx(False)`` or ``ATTNLAB_AMX=0`` sends them to the float32 tiles instead.

When the build fails (no compiler, ``CXX`` pointing nowhere, a compile error) or ``ATTNLAB_FUSED=0``, ``attend``
takes the PyTorch kernels of ``decode`` instead; the reason is reported once (a ``RuntimeWarning``) and stays
queryable: ``available()`` is False and ``status()`` says why.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from torch.autograd import forward_ad
from torch.utils.flop_counter import register_flop_formula

from ..config import env_switch

_SOURCE = Path(__file__).with_name("csrc")  # kernels.cpp, ops.cpp and the headers they include
# -ffp-contract=fast: a * b + c becomes one FMA (GCC leaves it off in ISO C++ modes). -fvisibility=hidden: a second
# build loaded beside the first (kernel_ab, the tests' AVX2 build) keeps its own functions and template statics.
# -std=c++17 (after torch's -std=c++20): the kernel unit's standard headers parse ~1 s faster.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fvisibility=hidden", "-std=c++17"]
# ATTNLAB_ISA: the vector instructions the build may use. "native" (the default): all this CPU has; "avx2": no
# AVX-512 (nor AMX, which needs it), so that an AVX-512 machine builds, tests and times the kernels that AVX2-only
# CPUs (AMD Zen 1-3, older Intel) run. The flags join the build's name: each choice is cached beside the others.
_ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",)}
_NAMESPACE = "attnlab"  # the operators' (torch.ops.attnlab); benchmarks/kernel_ab.py renames it in its copies
_DTYPES = (torch.float32, torch.bfloat16)
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # a parameter is a plain tensor to the kernels
_lock = threading.Lock()
_state: dict[str, object] = {"ops": None, "tried": False, "status": "not built yet", "build_s": None}


def _cpuinfo(field: str) -> str | None:
    """The first line of /proc/cpuinfo that starts with ``field`` (None where there is no such file or line)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them ("avx2", "avx512f", "amx_tile", ...); empty elsewhere."""
    line = _cpuinfo("flags")
    return set(line.split(":", 1)[1].split()) if line else set()


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 9R14", ...), as /proc/cpuinfo gives it."""
    line = _cpu_model()
    return line.split(":", 1)[1].strip() if line.startswith("model name") else line


def _compiler() -> str:
    """The C++ compiler the extension builder runs (``torch.utils.cpp_extension.get_cxx_compiler``)."""
    return os.environ.get("CXX", "c++")


@functools.cache
def _compiler_version(cxx: str) -> str | None:
    """Where ``cxx`` resolves and the first line of its ``--version`` (a few milliseconds, once per process):
    an upgraded compiler changes the name. None when there is no such program."""
    path = shutil.which(cxx)
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return " ".join([os.path.realpath(path), *out.splitlines()[:1]])


def _source_files(source: Path) -> list[Path]:
    """The files of the kernel in the directory ``source``: the compiled unit and the headers it includes."""
    return sorted(p for p in source.iterdir() if p.suffix in (".cpp", ".h"))


def build_inputs(source: Path = _SOURCE, flags: tuple[str, ...] = ()) -> dict[str, str]:
    """Everything the build file that ``torch.utils.cpp_extension.load`` writes (build.ninja) is made from, and
    so everything a cached build must match: the sources' names and texts and their directory, the flags, the
    compiler (``$CXX``, else ``c++``), the Python environment (its prefix; the Python headers' directory, which the build includes), the
    PyTorch installation (its version; its directory, whose headers and libraries the build names) and the CPU
    (``-march=native``)."""
    cxx = _compiler()
    return {
        "source": "".join(f"// {p.name}\n{p.read_text()}" for p in _source_files(source)),
        "source_path": str(source.resolve()),
        "flags": " ".join([*_FLAGS, *flags]),
        "compiler": f"{cxx}: {_compiler_version(cxx)}",
        "python": f"{sys.prefix} {sysconfig.get_path('include', scheme='posix_prefix')}",
        "torch": f"{torch.__version__} {Path(torch.__file__).resolve().parent}",
        "cpu": _cpu_model(),
    }


def extension_name(source: Path = _SOURCE, flags: tuple[str, ...] = ()) -> str:
    """The name the build is cached under: a hash of ``build_inputs``."""
    key = json.dumps(build_inputs(source, flags), sort_keys=True)
    return "attnlab_fused_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _build_root() -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


# Where the last build's duration is kept, in the build root: the next build's announced estimate.
_BUILD_SECONDS = "attnlab_fused_build_seconds"
_DEFAULT_BUILD_S = 15  # seconds: 5-40 s were seen, depending on the machine and its load


def _announce_build(root: Path) -> None:
    try:
        estimate = float((root / _BUILD_SECONDS).read_text())
    except (OSError, ValueError):
        estimate = _DEFAULT_BUILD_S
    print(
        f"attnlab: building the decode kernel for this CPU (first use, ~{max(1, round(estimate))} s)",
        file=sys.stderr,
        flush=True,
    )


@contextlib.contextmanager
def _build_lock(directory: Path):
    """Hold the build directory alone. PyTorch's own lock is a file that the builder creates and deletes; a build
    that is killed (Ctrl-C, a timeout) leaves it behind, and every later build of the same name then waits for it
    forever. This lock is the kernel's (flock): released when its holder ends, however it ends. Whoever holds it is
    the only attnlab process building here, so a PyTorch lock file found then is stale and is removed."""
    try:
        import fcntl
    except ImportError:  # not POSIX: PyTorch's lock alone
        yield
        return
    with open(directory / "attnlab.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(source: Path, flags: tuple[str, ...] = ()) -> str:
    """Compile (or find the cached build of) the kernel; the path of the shared library.

    A compile is needed when the library is missing or older than a source (ninja's own rule, the build's
    command being fixed by the name); it is announced on stderr first, unless there is no compiler to run.
    """
    from torch.utils.cpp_extension import load

    name = extension_name(source, flags)
    root = _build_root()
    directory = root / name
    library = directory / f"{name}.so"
    newest = max(p.stat().st_mtime for p in _source_files(source))
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        # asked once the lock is ours: a process that waited for another's build finds it done (it announced a
        # build it never made)
        compiles = not library.is_file() or library.stat().st_mtime < newest
        if compiles and _compiler_version(_compiler()) is not None:
            _announce_build(root)
        start = time.perf_counter()
        path = load(
            name=name,
            sources=[str(source / "kernels.cpp"), str(source / "ops.cpp")],
            extra_cflags=[*_FLAGS, *flags],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    if compiles:
        # an estimate only, written whole (another process may read it): a temporary file renamed over it
        with contextlib.suppress(OSError):
            temp = root / f"{_BUILD_SECONDS}.{os.getpid()}.tmp"
            temp.write_text(f"{time.perf_counter() - start:.1f}\n")
            os.replace(temp, root / _BUILD_SECONDS)
    return path


class BlockWeights(NamedTuple):
    """A decoder block's tensors for ``block_step``, named as the operator's schema names them (the schema is made
    from these fields, and the C++ kernel reads each by its name): norm gains (D), weights as ``nn.Linear`` holds
    them, biases or None."""

    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    ffn_norm: torch.Tensor
    w1: torch.Tensor  # gate
    w3: torch.Tensor  # up
    w2: torch.Tensor  # down
    b1: torch.Tensor | None
    b3: torch.Tensor | None
    b2: torch.Tensor | None


def _schemas() -> dict[str, str]:
    """The operators' signatures (torch.library's schema language): the one definition of the kernels' interface."""
    weights = ", ".join(
        f"Tensor{'?' if 'None' in str(kind) else ''} {name}"
        for name, kind in BlockWeights.__annotations__.items()
    )
    return {
        "decode": "decode(Tensor q, Tensor k, Tensor v, float scale) -> Tensor",
        "mla_decode": "mla_decode(Tensor q, Tensor rows, int value_dim, float scale) -> Tensor",
        "static_decode": "static_decode(Tensor q, Tensor k, Tensor v, Tensor lengths, int window, float scale) -> Tensor",
        "paged_decode": "paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, int[] table, int block, int[] first, "
        "int[] lengths, float scale) -> Tensor",
        "linear": "linear(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor",
        "block_step": f"block_step(Tensor x, {weights}, Tensor? cos, Tensor? sin, Tensor(a!) cache_k, "
        "Tensor(b!) cache_v, int pos, float eps, float scale) -> Tensor",
        "amx": "amx(int on) -> int",
        "signatures": "signatures() -> str[]",
    }


def _argument_names(schema: str) -> str:
    """ "decode(Tensor q, Tensor k, Tensor v, float scale) -> Tensor" -> "decode(q, k, v, scale)"."""
    name, rest = schema.split("(", 1)
    arguments = rest.rsplit(") ->", 1)[0]
    return f"{name}({', '.join(a.split()[-1] for a in arguments.split(', ') if a)})"


# Fake implementations: the output's shape and dtype (a new contiguous tensor, as the kernels allocate), from the
# operands alone. FLOP formulas: 2 per multiply-add, as attnlab.cost counts (scores q k^T and values p v over the
# attended keys; a linear layer's x W^T; biases, norms, RoPE and softmax not counted).


def _attention_out(q: torch.Tensor, dv) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], 1, dv)


def _attention_flops(q_shape, keys: int, dv: int) -> int:
    """``keys``: attended keys summed over the batch rows."""
    return 2 * q_shape[1] * keys * (q_shape[3] + dv)


def _linear_flops(x_shape, weight_shapes) -> int:
    rows = math.prod(x_shape[:-1])
    return 2 * rows * x_shape[-1] * sum(w[0] for w in weight_shapes)


def _block_flops(x_shape, weights: BlockWeights, pos: int) -> int:
    """x (B, 1, D): q/k/v, gate and up projections of the input, the output and down projections, and each query
    head (H of head_dim: the query width) over the pos + 1 cached keys, scores and values."""
    rows, d, qw, ffn = x_shape[0], x_shape[-1], weights.wq[0], weights.w1[0]
    projections = _linear_flops(x_shape, [weights.wq, weights.wk, weights.wv, weights.w1, weights.w3])
    return projections + 2 * rows * (qw + ffn) * d + 2 * rows * qw * (pos + 1) * 2


def _register(namespace: str, library: torch.library.Library) -> None:
    """Fake implementations and FLOP formulas of ``namespace``'s operators."""
    ops = getattr(torch.ops, namespace)

    def fake(name):
        return torch.library.register_fake(f"{namespace}::{name}", lib=library)

    def flops(name):
        return register_flop_formula(getattr(ops, name))

    @fake("decode")
    def _(q, k, v, scale):
        return _attention_out(q, v.shape[-1])

    @fake("mla_decode")
    def _(q, rows, value_dim, scale):
        return _attention_out(q, value_dim)

    @fake("static_decode")
    def _(q, k, v, lengths, window, scale):
        return _attention_out(q, v.shape[-1])

    @fake("paged_decode")
    def _(q, k_pool, v_pool, table, block, first, lengths, scale):
        return _attention_out(q, v_pool.shape[-1])

    @fake("linear")
    def _(x, weights, biases):
        return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))

    @fake("block_step")
    def _(x, *args):
        return x.new_empty(x.shape)

    @flops("decode")
    def _(q, k, v, scale, out_shape=None, **kwargs) -> int:
        return _attention_flops(q, q[0] * k[2], v[-1])

    @flops("mla_decode")
    def _(q, rows, value_dim, scale, out_shape=None, **kwargs) -> int:
        return _attention_flops(q, q[0] * rows[2], value_dim)

    @register_flop_formula(ops.static_decode, get_raw=True)
    def _(q, k, v, lengths, window, scale, out_shape=None, **kwargs) -> int:
        # the keys each row reads: its length (its last `window` with one), where the lengths can be read (a CPU
        # tensor, as the kernel takes); traced (fake) lengths have none: every slot, as the masked path computes
        if type(lengths) is torch.Tensor and lengths.device.type == "cpu":
            read = lengths.clamp(max=window) if window > 0 else lengths
            return _attention_flops(q.shape, int(read.sum()), v.shape[-1])
        return _attention_flops(q.shape, q.shape[0] * k.shape[2], v.shape[-1])

    @flops("paged_decode")
    def _(q, k_pool, v_pool, table, block, first, lengths, scale, out_shape=None, **kwargs) -> int:
        return _attention_flops(q, sum(n - f for f, n in zip(first, lengths, strict=True)), v_pool[-1])

    @flops("linear")
    def _(x, weights, biases, out_shape=None, **kwargs) -> int:
        return _linear_flops(x, weights)

    @flops("block_step")
    def _(x, *args, out_shape=None, **kwargs) -> int:
        weights = BlockWeights(*args[: len(BlockWeights._fields)])
        pos = args[len(BlockWeights._fields) + 4]  # after cos, sin, cache_k, cache_v
        return _block_flops(x, weights, pos)


_LIBRARIES: dict[
    str, torch.library.Library
] = {}  # namespace -> its definitions (kept: they live as long as it)


def define(namespace: str = _NAMESPACE) -> None:
    """Define ``namespace``'s operators (once): schemas, fake implementations, FLOP formulas and the kernels that
    answer before a build (``_unbuilt``)."""
    if namespace in _LIBRARIES:
        return
    library = torch.library.Library(namespace, "DEF")
    for name, schema in _schemas().items():
        library.define(schema)
        # amx and signatures take no tensor: the build registers them for every key
        if name not in ("amx", "signatures"):
            library.impl(name, _unbuilt(namespace, name), "CompositeExplicitAutograd")
            library.impl(name, _no_backward(namespace, name), "Autograd")
    _register(namespace, library)
    _LIBRARIES[namespace] = library


def _unbuilt(namespace: str, name: str):
    """The kernel of ``torch.ops.<namespace>.<name>`` for a tensor no compiled kernel takes. The build registers the
    C++ kernels for CPU tensors, which the dispatcher then prefers to this one; before it, a call on CPU tensors
    builds the package's operators (as ``ensure_built`` does) and dispatches again. Anything else is an error that
    says why."""

    def kernel(*args):
        qualified = f"{namespace}::{name}"
        device = next(
            (
                t.device
                for a in args
                for t in (a if isinstance(a, list) else [a])
                if isinstance(t, torch.Tensor)
            ),
            torch.device("cpu"),
        )
        if device.type != "cpu":
            raise NotImplementedError(
                f"torch.ops.{namespace}.{name}: the attnlab kernels take CPU tensors only, got {device}"
            )
        built = namespace == _NAMESPACE and _library() is not None
        if built and torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU"):
            return getattr(getattr(torch.ops, namespace), name).default(*args)
        why = status() if namespace == _NAMESPACE else "this namespace's build (load_library) is not loaded"
        raise RuntimeError(f"torch.ops.{namespace}.{name}: the C++ kernels are not available: {why}")

    return kernel


def _no_backward(namespace: str, name: str):
    """The kernel of ``torch.ops.<namespace>.<name>`` on the Autograd key. The kernels have no derivatives: a call
    that would record a backward, or carry a forward-mode tangent (``torch.func.jvp``, ``forward_ad``), is refused,
    naming the operand (PyTorch's fallback gave gradients of None, with a warning only at ``backward``, and zero
    tangents). Any other call goes on to the kernel below, and the tensors it writes (``block_step``'s caches) get
    their version bumped, as PyTorch does for an in-place op, so that a backward that saved them says so."""
    resolved: list = []

    def kernel(*args):
        if not resolved:
            op = getattr(getattr(torch.ops, namespace), name).default
            arguments = op._schema.arguments
            written = [
                i for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write
            ]
            resolved.extend((op, arguments, written))
        op, arguments, written = resolved
        grad = torch.is_grad_enabled()
        tangents = tangents_on()
        if grad or tangents:
            for argument, value in zip(arguments, args, strict=False):
                for t in value if isinstance(value, (list, tuple)) else [value]:
                    why = _differentiated(t, grad, tangents) if isinstance(t, torch.Tensor) else None
                    if why:
                        raise ValueError(
                            f"torch.ops.{namespace}.{name}: {argument.name} {why}, and the attnlab kernels have no "
                            "derivatives; call it where nothing is differentiated, or through "
                            "attnlab.attention.attend, which sends such calls to a backend that has them"
                        )
        with torch._C._AutoDispatchBelowAutograd():
            out = op(*args)
        for i in written:
            if not args[i].is_inference():
                torch.autograd.graph.increment_version(args[i])
        return out

    return kernel


def tangents_on() -> bool:
    """Whether any operand may carry a forward-mode tangent: a ``forward_ad`` dual level is open, or ``torch.func``'s
    transforms run (two cheap reads; ``_differentiated`` then looks at each operand)."""
    return forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()


def _differentiated(t: torch.Tensor, grad: bool, tangents: bool) -> str | None:
    """Why an operand would be differentiated (None: it would not): it requires grad, carries ``forward_ad``'s
    tangent, or is tracked by ``torch.func``'s grad or jvp transform."""
    if grad and t.requires_grad:
        return "requires grad"
    if tangents and forward_ad._current_level >= 0 and forward_ad.unpack_dual(t).tangent is not None:
        return "carries a forward-mode tangent"
    if tangents and torch._C._functorch.is_gradtrackingtensor(t):
        return "is tracked by torch.func's grad or jvp transform"
    return None


define()


class Ops:
    """One build's operators (``torch.ops.<namespace>``), each as its ``OpOverload``: called as is, it costs one pass
    through the dispatcher (the packet's overload resolution skipped)."""

    def __init__(self, namespace: str) -> None:
        ops = getattr(torch.ops, namespace)
        self.namespace = namespace
        self.decode = ops.decode.default
        self.mla_decode = ops.mla_decode.default
        self.static_decode = ops.static_decode.default
        self.paged_decode = ops.paged_decode.default
        self.linear = ops.linear.default
        self.block_step = ops.block_step.default
        self.amx = ops.amx.default
        self.signatures = ops.signatures.default


def isa_flags() -> tuple[str, ...]:
    """The flags ``ATTNLAB_ISA`` adds to the build (see ``_ISA_FLAGS``); a ValueError naming it for another value."""
    name = os.environ.get("ATTNLAB_ISA", "native").strip().lower() or "native"
    if name not in _ISA_FLAGS:
        raise ValueError(f"ATTNLAB_ISA={name!r}: expected one of {', '.join(_ISA_FLAGS)}")
    return _ISA_FLAGS[name]


def _library_flags(flags: tuple[str, ...], namespace: str) -> tuple[str, ...]:
    return (*flags, f"-DATTNLAB_OPS={namespace}")


def library_name(flags: tuple[str, ...] | None = None, namespace: str = _NAMESPACE) -> str:
    """The extension cache's name for the operators under ``namespace`` built with ``flags`` (default: those
    ``ATTNLAB_ISA`` adds), as ``load_library`` builds them."""
    return extension_name(flags=_library_flags(isa_flags() if flags is None else flags, namespace))


def load_library(source: Path = _SOURCE, flags: tuple[str, ...] = (), namespace: str = _NAMESPACE) -> Ops:
    """The operators of the kernels compiled from the directory ``source`` with ``flags`` after the usual ones
    (built, or found in the extension cache), registered under ``namespace``; raises when they cannot be built or
    loaded. ``_library`` keeps this process's one copy of the package's kernels; a second build needs a namespace of
    its own (the tests build the kernels as CPUs without AVX-512 get them: ``flags=("-mno-avx512f",)``)."""
    if torch.torch_version.TorchVersion(torch.__version__) < (2, 13):
        raise RuntimeError(f"the kernels' operators need PyTorch 2.13 or later, this is {torch.__version__}")
    define(namespace)
    _build(source, _library_flags(flags, namespace))
    ops = Ops(namespace)
    check_signatures(ops)
    return ops


def check_signatures(ops: Ops) -> None:
    """The kernels read their arguments by the names in csrc/ops.cpp: those must be the schemas' names, in the
    schemas' order (a kernel that read another argument than the one passed would compute garbage)."""
    want = [_argument_names(s) for name, s in _schemas().items() if name != "signatures"]
    got = list(ops.signatures())
    if got != want:
        raise RuntimeError(f"the kernels read arguments {got}, but fused.py's schemas pass {want}")


_DISABLED = "disabled by ATTNLAB_FUSED=0: the PyTorch kernels run"


def _library() -> Ops | None:
    """The loaded operators, building them on the first call; None (reported once) when they cannot be built."""
    if _state["tried"]:
        return _state["ops"]  # type: ignore[return-value]
    with _lock:
        if _state["tried"]:
            return _state["ops"]  # type: ignore[return-value]
        if not env_switch("ATTNLAB_FUSED", True):
            _state.update(tried=True, status=_DISABLED)
            return None
        flags = isa_flags()  # a misspelt ATTNLAB_ISA is the user's error, not a failed build
        start = time.perf_counter()
        try:
            ops = load_library(flags=flags)
        except Exception as err:  # any failure to compile or load: fall back, and say so
            reason = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            _state.update(tried=True, status=f"build failed, the PyTorch kernels run: {reason}")
            warnings.warn(
                f"attnlab: the fused C++ decode kernel could not be built ({reason}); using the PyTorch kernels",
                RuntimeWarning,
                stacklevel=_outside_attnlab(),
            )
            return None
        seconds = time.perf_counter() - start
        if not env_switch("ATTNLAB_AMX", True):
            ops.amx(0)
        _state.update(tried=True, ops=ops, build_s=seconds, status=_describe(ops, seconds))
        return ops


def _outside_attnlab() -> int:
    """The ``stacklevel`` (for a warning raised by the caller) of the first frame outside attnlab's and torch's
    packages, so that the warning names the user's line: a fixed level named attnlab's own code, the depth varying
    with the path that first asked for the kernels (a module's forward, through torch's ``Module.__call__``)."""
    packages = (str(Path(__file__).resolve().parents[1]), str(Path(torch.__file__).resolve().parent))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(packages):
        frame, level = frame.f_back, level + 1
    return level


def _describe(ops: Ops, seconds: float) -> str:
    """The status line of built kernels, as they run now (``use_amx`` switches the bfloat16 engine)."""
    engine = {_AMX: "AMX tiles", _DOTS: "AVX512-BF16 dot products"}.get(ops.amx(-1) & _PAIRS)
    tiles = f"; bfloat16 on {engine}" if engine else ""
    return f"fused C++ kernel ({seconds:.1f} s to load; {_ISA_NAMES[_isa(ops)]}{tiles})"


def available() -> bool:
    """Whether the fused kernels run (builds them on the first call). Tracing for ``torch.compile`` never builds:
    there, kernels not built yet answer False and the graph takes the PyTorch kernels (``ensure_built`` first puts
    the operators in the graph)."""
    if not _state["tried"] and torch.compiler.is_compiling():
        return False
    return _library() is not None


def ensure_built(device: torch.device | str = "cpu") -> None:
    """Build (or load) the kernel now if work on ``device`` may run it: a command calls this before it starts a
    clock, so that a first-use build (seconds to tens of seconds) is never part of a time it reports. Nothing for
    other devices: the kernel is for CPUs only."""
    if torch.device(device).type == "cpu":
        _library()


def status() -> str:
    """Which decode path runs and why: the fused kernel, or the PyTorch kernels and the reason."""
    ops = _state.get("ops")
    if ops is not None:  # read now: inside use_amx(False) it said bfloat16 ran on the pair path still
        return _describe(ops, float(_state["build_s"]))  # type: ignore[arg-type]
    if not _state["tried"] and not env_switch("ATTNLAB_FUSED", True):  # known before any build is tried
        return _DISABLED
    return str(_state["status"])


# The kernels' feature bits (kernels.h, features()): bfloat16 pairs on AMX tiles, 16-lane tiles, 8-lane tiles,
# bfloat16 pairs on AVX512-BF16 dot products; the pair path is either engine.
_AMX, _AVX512, _AVX2, _DOTS = 1, 2, 4, 8
_PAIRS = _AMX | _DOTS


def _has(bit: int) -> bool:
    """Whether the kernels run here with feature ``bit`` on (builds them on the first call)."""
    ops = _library()
    return ops is not None and bool(ops.amx(-1) & bit)


_ISA_NAMES = {"amx": "AVX-512", "avx512": "AVX-512", "avx2": "AVX2", "generic": "no AVX2"}


def _isa(ops: Ops) -> str:
    bits = ops.amx(-1)
    return "amx" if bits & _AMX else "avx512" if bits & _AVX512 else "avx2" if bits & _AVX2 else "generic"


def isa() -> str | None:
    """The instructions the kernels run on here: "amx" (bfloat16 blocks on AMX tiles, the rest AVX-512), "avx512"
    (16-lane vectors), "avx2" (8 lanes), "generic" (what the compiler makes of 8 lanes without AVX2); None when the
    kernels do not run. ``ATTNLAB_ISA=avx2`` builds the AVX2 kernels on an AVX-512 CPU."""
    ops = _library()
    return None if ops is None else _isa(ops)


def amx() -> bool:
    """Whether bfloat16 steps run on the CPU's AMX tiles (Intel Sapphire Rapids and later: the kernel built for the
    CPU, the tile state granted by the OS, and not turned off by ``use_amx(False)`` or ``ATTNLAB_AMX=0``)."""
    return _has(_AMX)


def bf16_dots() -> bool:
    """Whether bfloat16 steps of groups of 8 or more queries run on AVX512-BF16's dot products, in the tiles'
    layouts (AMD Zen 4 and later, Intel Cooper Lake; where there are AMX tiles, those run instead): the kernel
    built for the CPU, and not turned off by ``use_amx(False)`` or ``ATTNLAB_AMX=0``."""
    return _has(_DOTS)


@contextlib.contextmanager
def use_amx(on: bool):
    """Within the block, send bfloat16 steps to the pair path (the AMX tiles where the CPU has them, else
    AVX512-BF16's dot products where it has those) or not: to compare or test the paths on one machine.
    Process-wide: not for use while other threads decode."""
    ops = _library()
    if ops is None:
        yield
        return
    before = bool(ops.amx(-1) & _PAIRS)
    ops.amx(int(on))
    try:
        yield
    finally:
        ops.amx(int(before))


def build_seconds() -> float | None:
    """Seconds the first build-or-load of this process took (None before it, or when it failed)."""
    return _state["build_s"]  # type: ignore[return-value]


def reset() -> None:
    """Forget the build state, so that the next call builds (or fails) again; for tests."""
    _state.update(ops=None, tried=False, status="not built yet", build_s=None)


def _plain_operands(tensors, dtypes) -> bool:
    """Every tensor (None skipped) a plain CPU tensor or parameter (no subclass: not a DTensor) of one of
    ``dtypes``, with no gradient to record."""
    grad = torch.is_grad_enabled()
    tangents = tangents_on()
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _PLAIN_TYPES or t.device.type != "cpu" or t.dtype not in dtypes:
            return False
        if _differentiated(t, grad, tangents):
            return False
    return True


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    """q (B, H, 1, Dk) over k (B, n_kv, S, Dk), v (B, n_kv, S, Dv) (any strides but the last) -> (B, H, 1, Dv);
    ``mla_decode`` when v is the first Dv columns of k's rows (MLA's absorbed values). Call only where the "fused"
    backend takes the call (attention/kernels.py declares what it takes)."""
    ops: Ops = _state["ops"]  # type: ignore[assignment]
    if _first_columns(v, k):
        return ops.mla_decode(q, k, v.shape[-1], scale)
    return ops.decode(q, k, v, scale)


def _first_columns(v: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``v`` is ``k[..., :n]``: views of one tensor at the same offset and strides. Under ``torch.compile``,
    whose tracing knows no storage offsets, always False: MLA's step then runs as ``decode`` with v a view of k (the
    same kernel, under the other name)."""
    if torch.compiler.is_compiling():
        return False
    # the storage, not the view's base: views made under torch.inference_mode (generate's) record no _base
    return (
        v.dtype == k.dtype
        and k.untyped_storage().data_ptr() != 0  # (meta and empty tensors have no memory to share)
        and v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        and v.storage_offset() == k.storage_offset()
        and v.stride() == k.stride()
        and v.shape[:-1] == k.shape[:-1]
    )


def static_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, *, scale: float, window=None
) -> torch.Tensor:
    """q (B, H, 1, Dk) over fixed buffers k (B, n_kv, S, Dk), v (B, n_kv, S, Dv) (a ``StaticKVCache``'s; v may be a
    view of k's first columns) of which row b holds its first ``lengths[b]`` tokens (an integer CPU tensor, read by
    the kernel: a compiled step keeps it a tensor); with a ``window``, each row's last ``window`` of them. Only
    those rows are read."""
    ops: Ops = _state["ops"]  # type: ignore[assignment]
    return ops.static_decode(q, k, v, lengths.long(), window or 0, scale)


def paged_decode(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, runs, lengths, *, scale: float, window=None
):
    """q (B, H, 1, Dk) over paged rows: pools (n_kv, slots, D); batch row ``i`` holds ``lengths[i]`` tokens, the
    slots ``[start, start + n)`` of its ``runs[i]`` in order (a ``PagedView``'s fields). Every row in one call;
    with a ``window``, each row attends only to its last ``window`` tokens (the kernel starts the row there).

    The runs become a table of equal blocks: every run but a row's last starts and ends on a multiple of the
    cache's block size, so the greatest common divisor of those starts and lengths is a block size too.
    """
    bounds = [
        x for row in runs for i, (start, n) in enumerate(row) for x in (start, n if i < len(row) - 1 else 0)
    ]
    block = math.gcd(*bounds) or max([1, *lengths])
    per_row = [[start + j for start, n in row for j in range(0, n, block)] for row in runs]
    width = max([1, *map(len, per_row)])
    table = [0] * (len(runs) * width)
    for i, slots in enumerate(per_row):
        table[i * width : i * width + len(slots)] = slots
    first = [0] * len(runs) if window is None else [max(0, n - window) for n in lengths]
    ops: Ops = _state["ops"]  # type: ignore[assignment]
    return ops.paged_decode(q, k_pool, v_pool, table, block, first, list(lengths), scale)


# Rows of input up to which ``linear`` is used: it beats the BLAS product by 1.4-2.5x (float32) at 8 rows on the
# shapes of benchmarks/linear.py (benchmarks/results/linear.json).
LINEAR_MAX_ROWS = 8


def linear_supports(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether ``linear`` takes these operands: a CPU float32/bfloat16 input of 1 to ``LINEAR_MAX_ROWS`` rows,
    weights and biases (None: no bias) of its dtype, plain tensors or parameters, no gradient, no autocast (the
    kernel computes in its operands' dtype, ``nn.Linear`` in autocast's); and the kernel built."""
    if (
        x.device.type != "cpu"
        or x.dtype not in _DTYPES
        or x.numel() > LINEAR_MAX_ROWS * x.shape[-1]
        or x.numel() == 0
        or torch.is_autocast_enabled("cpu")
    ):
        return False  # the device first: on a GPU every linear layer of every step asks
    return _plain_operands((x, *params), (x.dtype,)) and available()


def linear(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None
) -> torch.Tensor:
    """``torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1)`` for a few rows of input: x (..., K),
    weights (N_i, K) -> (..., sum N_i), every weight row streamed once for all rows, the weights in one parallel
    pass. Call only when ``linear_supports(x, *weights, *biases)``."""
    ops: Ops = _state["ops"]  # type: ignore[assignment]
    return ops.linear(x, weights, biases or [None] * len(weights))


class BlockStep:
    """One pre-norm decoder block's decode step in one operator call (``block_step``; ``attnlab.model.Block``; see
    csrc/block.h): RMSNorm, q/k/v projections, RoPE, the cache write, attention over the cache, output projection
    and residual, RMSNorm, SwiGLU MLP and residual.

    Built once from the block's tensors (``BlockWeights``; their shapes are checked by the operator at every call),
    then called for every token: a layer's ~25 PyTorch ops and ~20 module attribute lookups become one call. Use
    only where the "fused" backend takes the block's step (``attnlab.model._FusedPlan`` asks the backend table);
    the caller rebuilds the step when a tensor is replaced.
    """

    def __init__(self, weights: BlockWeights, *, head_dim: int, eps: float, scale: float) -> None:
        self.weights = weights
        self.n_heads, self.n_kv, self.head_dim = (
            weights.wq.shape[0] // head_dim,
            weights.wk.shape[0] // head_dim,
            head_dim,
        )
        self.dtype, self.d_model = weights.wq.dtype, weights.attn_norm.shape[0]
        self.eps, self.scale = eps, scale

    def __call__(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        pos: int,
    ) -> torch.Tensor:
        """x (B, 1, D) contiguous -> (B, 1, D). ``rope``: float32 cos, sin of the new tokens, (1, head_dim) shared
        or (B, 1, head_dim) per row; None: no RoPE. ``cache_k``/``cache_v`` (B, n_kv, max_seq_len, head_dim) with
        contiguous rows: the new key (after RoPE) and value are written at ``pos``, and every row attends to its
        tokens 0 .. ``pos``."""
        cos, sin = (None, None) if rope is None else rope
        ops: Ops = _state["ops"]  # type: ignore[assignment]
        return ops.block_step(x, *self.weights, cos, sin, cache_k, cache_v, pos, self.eps, self.scale)
