"""The fused CPU decode kernel (``csrc/``): built at first use, with the PyTorch kernels as the fallback.

One query per head over a contiguous or paged cache in a single pass: per (batch row, KV head), the group's
queries are scored against each block of cached keys, an online softmax updates a running maximum and exp-sum,
and the block's values are accumulated, so every cached byte is read once (GQA, MQA and MLA's absorbed form,
whose values are the first columns of its key rows). Paged batches are attended together, in one call. See the
C++ sources (``csrc/decode.h``) for the algorithm. The same library holds the few-row matrix-vector product of decode-time linear layers
(``linear``) and a decoder block's whole decode step (``BlockStep``, used by ``attnlab.model.Block``).

Building: the first call compiles ``csrc/fused.cpp`` (one compiled unit that includes the headers of ``csrc/``,
one per concern) with ``torch.utils.cpp_extension.load`` (g++ with OpenMP, ``-O3 -march=native``) into PyTorch's extension cache (``$TORCH_EXTENSIONS_DIR``, else
``~/.cache/torch_extensions``) under a name that hashes everything the generated build file depends on
(``build_inputs``): the sources and their directory, the flags, the compiler, the Python environment and the PyTorch
installation whose headers it names, and the CPU model. So a build is reused by later processes of the same
environment on the same machine, and two environments (two virtual environments, two checkouts) keep one build
each rather than rebuilding each other's in turn. The sources include no PyTorch header (C functions called
through ``ctypes``), so the build takes seconds, not a minute; a build (not a load from the cache) says so
on stderr before it starts, once. Commands that time something call ``ensure_built`` before starting a clock.
On CPUs with AMX tiles (Intel Sapphire Rapids and later), bfloat16 steps whose groups have 8 or more queries run on
the tile unit (``csrc/amx.h`` says how); ``amx()`` says whether they do, ``use_amx(False)`` or ``ATTNLAB_AMX=0`` sends
them to the float32 tiles instead.

When the build fails (no compiler, ``CXX`` pointing nowhere, a compile error) or ``ATTNLAB_FUSED=0``, ``attend``
takes the PyTorch kernels of ``decode`` instead; the reason is reported once (a ``RuntimeWarning``) and stays
queryable: ``available()`` is False and ``status()`` says why.
"""

from __future__ import annotations

import contextlib
import ctypes
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

import torch

_SOURCE = Path(__file__).with_name("csrc")  # fused.cpp and the headers it includes
# -ffp-contract=fast: a * b + c becomes one FMA (GCC leaves it off in ISO C++ modes).
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-std=c++17"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # a parameter is a plain tensor to the kernels
_lock = threading.Lock()
_state: dict[str, object] = {"lib": None, "tried": False, "status": "not built yet", "build_s": None}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    compiles = not library.is_file() or library.stat().st_mtime < newest
    if compiles and _compiler_version(_compiler()) is not None:
        _announce_build(root)
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    path = load(
        name=name,
        sources=[str(source / "fused.cpp")],
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


def load_library(source: Path = _SOURCE, flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernel library compiled from the directory ``source`` (its ``fused.cpp``) with ``flags`` after the usual
    ones (built, or found in the extension cache), its C entry points typed; raises when it cannot be built or loaded. ``_library`` keeps this
    process's one copy of the package's kernel; benchmarks/kernel_ab.py loads two sources side by side, and the
    tests build the kernel as CPUs without AVX-512 get it (``flags=("-mno-avx512f",)``)."""
    lib = ctypes.CDLL(_build(source, flags))
    fn = lib.attnlab_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, *[ctypes.c_void_p] + [ctypes.c_int64] * 5, *[ctypes.c_void_p] * 4]
    fn.argtypes += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    fn.argtypes += [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    lin = lib.attnlab_linear
    lin.restype = ctypes.c_int
    lin.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    lin.argtypes += [ctypes.c_void_p] * 4 + [ctypes.c_int]
    # kernels from before the AMX path (benchmarks/kernel_ab.py --base) lack these two
    if hasattr(lib, "attnlab_set_amx"):
        lib.attnlab_features.restype = lib.attnlab_set_amx.restype = ctypes.c_int
        lib.attnlab_set_amx.argtypes = [ctypes.c_int]
    blk = lib.attnlab_block
    blk.restype = ctypes.c_int
    blk.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_float,
        ctypes.c_float,
        ctypes.c_int,
    ]
    return lib


def _library() -> ctypes.CDLL | None:
    """The loaded kernel, building it on the first call; None (reported once) when it cannot be built."""
    if _state["tried"]:
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if _state["tried"]:
            return _state["lib"]  # type: ignore[return-value]
        if os.environ.get("ATTNLAB_FUSED", "1") == "0":
            _state.update(tried=True, status="disabled by ATTNLAB_FUSED=0: the PyTorch kernels run")
            return None
        start = time.perf_counter()
        try:
            lib = load_library()
        except Exception as err:  # any failure to compile or load: fall back, and say so
            reason = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            _state.update(tried=True, status=f"build failed, the PyTorch kernels run: {reason}")
            warnings.warn(
                f"attnlab: the fused C++ decode kernel could not be built ({reason}); using the PyTorch kernels",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        seconds = time.perf_counter() - start
        if os.environ.get("ATTNLAB_AMX", "1") == "0":
            lib.attnlab_set_amx(0)
        tiles = "; bfloat16 on AMX tiles" if lib.attnlab_features() & 1 else ""
        _state.update(
            tried=True, lib=lib, build_s=seconds, status=f"fused C++ kernel ({seconds:.1f} s to load{tiles})"
        )
        return lib


def available() -> bool:
    """Whether the fused kernel runs (builds it on the first call)."""
    return _library() is not None


def ensure_built(device: torch.device | str = "cpu") -> None:
    """Build (or load) the kernel now if work on ``device`` may run it: a command calls this before it starts a
    clock, so that a first-use build (seconds to tens of seconds) is never part of a time it reports. Nothing for
    other devices: the kernel is for CPUs only."""
    if torch.device(device).type == "cpu":
        _library()


def status() -> str:
    """Which decode path runs and why: the fused kernel, or the PyTorch kernels and the reason."""
    return str(_state["status"])


def amx() -> bool:
    """Whether bfloat16 steps run on the CPU's AMX tiles (Intel Sapphire Rapids and later: the kernel built for the
    CPU, the tile state granted by the OS, and not turned off by ``use_amx(False)`` or ``ATTNLAB_AMX=0``)."""
    lib = _library()
    return lib is not None and hasattr(lib, "attnlab_features") and bool(lib.attnlab_features() & 1)


@contextlib.contextmanager
def use_amx(on: bool):
    """Within the block, send bfloat16 steps to the AMX tiles (where the CPU has them) or not: to compare or test
    the two paths on one machine. Process-wide: not for use while other threads decode."""
    lib = _library()
    if lib is None or not hasattr(lib, "attnlab_set_amx"):
        yield
        return
    before = amx()
    lib.attnlab_set_amx(int(on))
    try:
        yield
    finally:
        lib.attnlab_set_amx(int(before))


def build_seconds() -> float | None:
    """Seconds the first build-or-load of this process took (None before it, or when it failed)."""
    return _state["build_s"]  # type: ignore[return-value]


def reset() -> None:
    """Forget the build state, so that the next call builds (or fails) again; for tests."""
    _state.update(lib=None, tried=False, status="not built yet", build_s=None)


def _plain_operands(tensors, dtypes) -> bool:
    """Every tensor (None skipped) a plain CPU tensor or parameter (no subclass: not a DTensor) of one of
    ``dtypes``, with no gradient to record; and not compile tracing."""
    if torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _PLAIN_TYPES or t.device.type != "cpu" or t.dtype not in dtypes:
            return False
        if grad and t.requires_grad:
            return False
    return True


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> bool:
    """Whether the kernel can take these operands: one CPU query per head, float32 or bfloat16, no gradient,
    no dropout, no tensor subclass, no compile tracing; and the kernel built."""
    if q.shape[2] != 1 or dropout_p > 0.0:
        return False
    return _plain_operands((q, k, v), _DTYPES) and available()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its rows (last dim) are contiguous, as every cache's are; else a contiguous copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _int64s(values) -> ctypes.Array:
    """A C array of int64 (lighter than a tensor for a handful of numbers: no dispatch, no allocator)."""
    return (ctypes.c_int64 * len(values))(*values)


def _call(q, k, k_strides, v, v_strides, table, table_stride, block, lo, hi, scale) -> torch.Tensor:
    # A decode step is short (tens of microseconds to a millisecond), so this path keeps to a few cheap Python
    # operations: (B, H, 1, D) contiguous is (B, H, D) to the kernel, and the output is allocated as returned.
    b, h, _, dk = q.shape
    q = q.contiguous()
    n_kv, dv = k_strides[3], v.shape[-1]
    out = q.new_empty(b, h, 1, dv)
    rc = _state["lib"].attnlab_decode(  # type: ignore[union-attr]
        _DTYPES[q.dtype], q.data_ptr(), b, h, n_kv, dk, dv, k.data_ptr(), _int64s(k_strides[:3]), v.data_ptr(),
        _int64s(v_strides[:3]), table, table_stride, block, lo, hi,
        float(scale), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(
            f"fused decode: inconsistent shapes q {tuple(q.shape)}, k/v heads {n_kv} (code {rc})"
        )
    return out


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    """q (B, H, 1, Dk) over k (B, n_kv, S, Dk), v (B, n_kv, S, Dv) (any strides but the last, v may be a view of
    k's first columns) -> (B, H, 1, Dv). Call only when ``supports(q, k, v)``."""
    k, v = _rows(k), _rows(v)
    b, n_kv, s = k.shape[0], k.shape[1], k.shape[2]
    ks = (*k.stride()[:3], n_kv)
    vs = (*v.stride()[:3], n_kv)
    return _call(q, k, ks, v, vs, None, 0, 1, _int64s([0] * b), _int64s([s] * b), scale)


def paged_decode(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, runs, lengths, *, scale: float, window=None
):
    """q (B, H, 1, Dk) over paged rows: pools (n_kv, slots, D); batch row ``i`` holds ``lengths[i]`` tokens, the
    slots ``[start, start + n)`` of its ``runs[i]`` in order (a ``PagedView``'s fields). Every row in one call;
    with a ``window``, each row attends only to its last ``window`` tokens (the kernel starts the row there).

    The runs become a table of equal blocks: every run but a row's last starts and ends on a multiple of the
    cache's block size, so the greatest common divisor of those starts and lengths is a block size too.
    """
    k_pool, v_pool = _rows(k_pool), _rows(v_pool)
    bounds = [
        x for row in runs for i, (start, n) in enumerate(row) for x in (start, n if i < len(row) - 1 else 0)
    ]
    block = math.gcd(*bounds) or max([1, *lengths])
    per_row = [[start + j for start, n in row for j in range(0, n, block)] for row in runs]
    width = max([1, *map(len, per_row)])
    flat = [0] * (len(runs) * width)  # a C array straight from the ints: building tensors took ~27 us a step
    for i, slots in enumerate(per_row):
        flat[i * width : i * width + len(slots)] = slots
    table = _int64s(flat)
    n_kv = k_pool.shape[0]
    ks = (0, k_pool.stride(0), k_pool.stride(1), n_kv)
    vs = (0, v_pool.stride(0), v_pool.stride(1), n_kv)
    first = [0] * len(runs) if window is None else [max(0, n - window) for n in lengths]
    return _call(q, k_pool, ks, v_pool, vs, table, width, block, _int64s(first), _int64s(lengths), scale)


# Rows of input up to which ``linear`` is used: it beats the BLAS product by 1.4-2.5x (float32) at 8 rows on the
# shapes of benchmarks/linear.py (benchmarks/results/linear.json).
LINEAR_MAX_ROWS = 8


def linear_supports(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether ``linear`` takes these operands: a CPU float32/bfloat16 input of 1 to ``LINEAR_MAX_ROWS`` rows,
    weights and biases (None: no bias) of its dtype, plain tensors or parameters, no gradient, no compile
    tracing; and the kernel built."""
    if x.dtype not in _DTYPES or x.numel() > LINEAR_MAX_ROWS * x.shape[-1] or x.numel() == 0:
        return False
    return _plain_operands((x, *params), (x.dtype,)) and available()


def linear(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None
) -> torch.Tensor:
    """``torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1)`` for a few rows of input: x (..., K),
    weights (N_i, K) -> (..., sum N_i), every weight row streamed once for all rows, the weights in one parallel
    pass. Call only when ``linear_supports(x, *weights, *biases)``."""
    biases = biases or [None] * len(weights)
    k = x.shape[-1]
    for w in weights:
        if w.ndim != 2 or w.shape[1] != k:
            raise ValueError(f"fused linear: weight of shape {tuple(w.shape)} for an input of width {k}")
    x2 = x.reshape(-1, k).contiguous()
    weights = [w.contiguous() for w in weights]
    biases = [None if b is None else b.contiguous() for b in biases]
    ns = [w.shape[0] for w in weights]
    out = x.new_empty(*x.shape[:-1], sum(ns))
    ptrs = (ctypes.c_void_p * len(ns))(*[w.data_ptr() for w in weights])
    bias_ptrs = (ctypes.c_void_p * len(ns))(*[None if b is None else b.data_ptr() for b in biases])
    rc = _state["lib"].attnlab_linear(  # type: ignore[union-attr]
        _DTYPES[x.dtype], x2.data_ptr(), x2.shape[0], k, len(ns), ptrs, (ctypes.c_int64 * len(ns))(*ns),
        bias_ptrs, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"fused linear: bad shapes x {tuple(x.shape)}, weights {ns} (code {rc})")
    return out


def block_supports(x: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    """Whether ``BlockStep`` takes a decode step of ``x`` (B, 1, D): 1 to ``LINEAR_MAX_ROWS`` rows of one token,
    CPU float32/bfloat16, every tensor (weights, biases, the cache) plain and of x's dtype, no gradient, no
    compile tracing; and the kernel built."""
    if x.dtype not in _DTYPES or x.ndim != 3 or x.shape[1] != 1 or not 1 <= x.shape[0] <= LINEAR_MAX_ROWS:
        return False
    return _plain_operands((x, *tensors), (x.dtype,)) and available()


class BlockStep:
    """One pre-norm decoder block's decode step in one kernel call (``attnlab.model.Block``; see ``block`` in
    fused.cpp): RMSNorm, q/k/v projections, RoPE, the cache write, attention over the cache, output projection and
    residual, RMSNorm, SwiGLU MLP and residual.

    Built once from the block's tensors, whose shapes are checked here (the kernel trusts them) and whose
    addresses are kept in the argument arrays, then called for every token: a layer's ~25 PyTorch ops and ~20
    module attribute lookups become one call. ``qkv`` = (wq, wk, wv, bq, bk, bv), ``out_proj`` = (wo, bo),
    ``mlp`` = (w1, w3, w2, b1, b3, b2) (gate, up, down), a bias None for none; all contiguous, of one dtype.
    Use only while ``block_supports`` them; the caller rebuilds the step when a tensor is replaced.
    """

    def __init__(
        self,
        attn_norm: torch.Tensor,
        qkv: tuple[torch.Tensor | None, ...],
        out_proj: tuple[torch.Tensor, torch.Tensor | None],
        ffn_norm: torch.Tensor,
        mlp: tuple[torch.Tensor | None, ...],
        *,
        head_dim: int,
        eps: float,
        scale: float,
    ) -> None:
        wq, wk, wv, bq, bk, bv = qkv
        wo, bo = out_proj
        w1, w3, w2, b1, b3, b2 = mlp
        d = attn_norm.shape[0]
        self.n_heads, self.n_kv, self.head_dim = wq.shape[0] // head_dim, wk.shape[0] // head_dim, head_dim
        ffn, qw, kw = w1.shape[0], wq.shape[0], wk.shape[0]
        expect = {
            "attention norm": (attn_norm, (d,)),
            "wq": (wq, (self.n_heads * head_dim, d)),
            "wk": (wk, (self.n_kv * head_dim, d)),
            "wv": (wv, (kw, d)),
            "wo": (wo, (d, qw)),
            "ffn norm": (ffn_norm, (d,)),
            "w1": (w1, (ffn, d)),
            "w3": (w3, (ffn, d)),
            "w2": (w2, (d, ffn)),
        }
        for name, bias, n in (("bq", bq, qw), ("bk", bk, kw), ("bv", bv, kw), ("bo", bo, d)):
            if bias is not None:
                expect[name] = (bias, (n,))
        for name, bias, n in (("b1", b1, ffn), ("b3", b3, ffn), ("b2", b2, d)):
            if bias is not None:
                expect[name] = (bias, (n,))
        for name, (t, shape) in expect.items():
            if tuple(t.shape) != shape or not t.is_contiguous() or t.dtype != wq.dtype:
                raise ValueError(
                    f"fused block step: {name} is {tuple(t.shape)} {t.dtype}, expected contiguous {shape} {wq.dtype}"
                )
        if self.n_heads == 0 or self.n_kv == 0 or self.n_heads % self.n_kv or head_dim % 2:
            raise ValueError(
                f"fused block step: {self.n_heads} query heads over {self.n_kv} KV heads of dim {head_dim}"
            )
        self.dtype, self.d_model = wq.dtype, d
        self._tensors = (attn_norm, wq, wk, wv, bq, bk, bv, wo, bo, ffn_norm, w1, w3, w2, b1, b3, b2)
        # pointers: x, the 16 above, cos, sin, cache keys, cache values, out (the per-call ones set in __call__)
        self._ptrs = (ctypes.c_void_p * 22)(
            None, *[None if t is None else t.data_ptr() for t in self._tensors]
        )
        self._dims = (ctypes.c_int64 * 14)(0, d, self.n_heads, self.n_kv, head_dim, ffn)
        self._eps, self._scale = ctypes.c_float(eps), ctypes.c_float(scale)

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
        b = x.shape[0]
        if (
            x.shape != (b, 1, self.d_model)
            or not x.is_contiguous()
            or cache_k.shape[:2] != (b, self.n_kv)
            or cache_k.shape[3] != self.head_dim
            or cache_v.shape != cache_k.shape
            or cache_k.stride(-1) != 1
            or cache_v.stride(-1) != 1
            or not 0 <= pos < cache_k.shape[2]
        ):
            raise ValueError(
                f"fused block step: x {tuple(x.shape)}, cache {tuple(cache_k.shape)} at position {pos} for "
                f"{self.n_kv} KV heads of dim {self.head_dim} and width {self.d_model}"
            )
        out = torch.empty_like(x)
        ptrs, dims = self._ptrs, self._dims
        ptrs[0], ptrs[19], ptrs[20], ptrs[21] = (
            x.data_ptr(),
            cache_k.data_ptr(),
            cache_v.data_ptr(),
            out.data_ptr(),
        )
        dims[0], dims[6] = b, pos
        dims[7:10], dims[10:13] = cache_k.stride()[:3], cache_v.stride()[:3]
        if rope is None:
            ptrs[17] = ptrs[18] = None
        else:
            cos, sin = rope
            rows = cos.numel() // self.head_dim
            if (
                cos.dtype != torch.float32
                or not cos.is_contiguous()
                or not sin.is_contiguous()
                or rows not in (1, b)
            ):
                raise ValueError(
                    f"fused block step: cos/sin must be contiguous float32 (1 or {b} rows), got {cos.shape}"
                )
            ptrs[17], ptrs[18] = cos.data_ptr(), sin.data_ptr()
            dims[13] = self.head_dim if rows > 1 else 0
        rc = _state["lib"].attnlab_block(  # type: ignore[union-attr]
            _DTYPES[self.dtype], dims, ptrs, self._eps, self._scale, torch.get_num_threads()
        )
        if rc != 0:
            raise ValueError(f"fused block step: the kernel rejected dims {list(dims)} (code {rc})")
        return out
