"""The per-rank figures of tensor parallelism for a few presets, from the cost model (``attnlab.cost``), and the
generated parts of docs/parallel.md: the head-to-rank diagrams and the per-rank table with its sentences.

Nothing is measured: every figure is a pure function of the presets and the hardware table, so the page can be
rebuilt at any time and a test checks that it is what the cost model says today.

    python benchmarks/tp_table.py     # writes benchmarks/results/tp_table.json and the generated parts of docs/parallel.md
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from attnlab.atomic import write_atomic
from attnlab.config import AttentionConfig, MLAConfig
from attnlab.cost import get_hardware, get_preset, roofline
from attnlab.cost.memory import kv_cache_bytes
from attnlab.cost.parallel import (
    allreduce_bytes_per_token_per_layer,
    kv_heads_per_rank,
    kv_replicas,
    rank_config,
    tp_comm,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # locations.py, beside this script
from locations import own_path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {
    "llama-3-8b": (2, 8),
    "llama-2-70b": (8, 16),
    "qwen2.5-72b": (8, 16),
    "llama-3.1-405b": (8, 16),
    "deepseek-v2-lite": (4, 16),
    "deepseek-v3": (8, 16, 32),
}
SETTING = {"hardware": "h100", "dtype": "bf16", "batch": 1, "seq_len": 4096}
DIAGRAMS = [  # (label, attention config, tp): one of each case of the rules
    ("MHA, 8 heads, tp 4", AttentionConfig(d_model=512, n_heads=8), 4),
    ("GQA, 8 heads / 4 KV heads, tp 2 (KV heads split)", AttentionConfig(d_model=512, n_heads=8, n_kv_heads=4), 2),
    ("GQA, 8 heads / 2 KV heads, tp 4 (each KV head on 2 ranks)", AttentionConfig(d_model=512, n_heads=8, n_kv_heads=2), 4),
    ("MQA, 8 heads, tp 4 (the KV head on every rank)", AttentionConfig(d_model=512, n_heads=8, n_kv_heads=1), 4),
    ("MLA, 8 heads, tp 4", MLAConfig(d_model=512, n_heads=8, kv_lora_rank=256, qk_nope_head_dim=64,
                                     qk_rope_head_dim=32, v_head_dim=64), 4),
]  # fmt: skip


def diagram(label: str, cfg: AttentionConfig | MLAConfig, tp: int) -> str:
    """One line per rank: its query heads, and the KV heads (or latent) it holds and caches."""
    q = cfg.n_heads // tp
    lines = [f"{label}:"]
    for r in range(tp):
        heads = " ".join(f"q{i}" for i in range(r * q, (r + 1) * q))
        if isinstance(cfg, MLAConfig):
            kv = "latent (whole: wkv_a, kv_norm replicated), wkv_b rows of its heads"
        else:
            n = kv_heads_per_rank(cfg, tp)
            first = r * q // cfg.n_rep  # the KV head its first query head reads
            kv = " ".join(f"kv{j}" for j in range(first, first + n))
            if kv_replicas(cfg, tp) > 1:
                kv += f"  (also on {kv_replicas(cfg, tp) - 1} other rank{'s' if kv_replicas(cfg, tp) > 2 else ''})"
        lines.append(f"  rank {r}: {heads:<{4 * q - 1}} | caches {kv}")
    return "\n".join(lines)


def rows() -> list[dict]:
    hw = get_hardware(SETTING["hardware"])
    out = []
    for name, tps in PRESETS.items():
        model = get_preset(name)
        attn = model.attention
        whole = kv_cache_bytes(model, 1, 1, SETTING["dtype"])
        for tp in tps:
            local = rank_config(model, tp)
            per_rank = kv_cache_bytes(local, 1, 1, SETTING["dtype"])
            r = roofline(
                model, hw, batch=SETTING["batch"], seq_len=SETTING["seq_len"], dtype=SETTING["dtype"], tp=tp
            )
            comm = tp_comm(model, hw, tp, tokens=1, sampled=1, dtype=SETTING["dtype"])
            out.append(
                {
                    "model": name,
                    "tp": tp,
                    "variant": attn.variant,
                    "n_layers": model.n_layers,
                    "n_heads": attn.n_heads,
                    "n_kv_heads": attn.n_kv_heads if isinstance(attn, AttentionConfig) else None,
                    "cached_values_per_layer": (
                        2 * attn.head_dim if isinstance(attn, AttentionConfig) else attn.cache_dim
                    ),
                    "q_heads_per_rank": attn.n_heads // tp,
                    "kv_heads_per_rank": kv_heads_per_rank(attn, tp),
                    "kv_replicas": kv_replicas(attn, tp),
                    "kv_bytes_per_token": whole,
                    "kv_bytes_per_token_per_rank": per_rank,
                    "kv_bytes_per_token_even_split": whole / tp,
                    "weight_bytes_per_rank": r.weight_bytes,
                    "allreduce_bytes_per_token_per_layer": allreduce_bytes_per_token_per_layer(
                        model, SETTING["dtype"]
                    ),
                    "link_bytes_per_s": comm.link_bandwidth,
                    "collectives_per_step": comm.collectives,
                    "decode_step_seconds": r.decode.seconds,
                    "decode_comm_seconds": r.decode.comm_seconds,
                    "decode_bound": r.decode.bound,
                }
            )
    return out


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def table(data: list[dict]) -> str:
    head = (
        "| model | attention | tp | query heads / rank | KV heads / rank x ranks each | KV bytes / token, whole model "
        "| per rank | even split (whole / tp) | per rank / even split | weights / rank | all-reduce bytes / token / "
        "layer | collectives / step | decode step (of which all-reduce bandwidth) |\n|" + "---|" * 13
    )
    lines = [head]
    for r in data:
        attn = f"{r['variant'].upper()} {r['n_heads']}/{r['n_kv_heads']}" if r["n_kv_heads"] else "MLA"
        kv = (
            f"{r['kv_heads_per_rank']} x{r['kv_replicas']}"
            if r["n_kv_heads"]
            else f"latent x{r['kv_replicas']}"
        )
        lines.append(
            f"| {r['model']} | {attn} | {r['tp']} | {r['q_heads_per_rank']} | {kv} | {r['kv_bytes_per_token']:,} | "
            f"{r['kv_bytes_per_token_per_rank']:,} | {r['kv_bytes_per_token_even_split']:,.0f} | "
            f"{r['kv_bytes_per_token_per_rank'] / r['kv_bytes_per_token_even_split']:.0f}x | "
            f"{_gb(r['weight_bytes_per_rank'])} | {r['allreduce_bytes_per_token_per_layer']:,} | "
            f"{r['collectives_per_step']} | "
            f"{r['decode_step_seconds'] * 1e3:.2f} ms ({r['decode_comm_seconds'] * 1e3:.3f} ms) |"
        )
    return "\n".join(lines)


def explain(r: dict) -> str:
    """The sentence that derives one row's per-rank KV bytes from its head counts."""
    layers, dt = r["n_layers"], 2  # bf16
    if r["n_kv_heads"] is None:
        return (
            f"- {r['model']} at tp {r['tp']}: MLA caches one latent row of {r['cached_values_per_layer']} values per "
            f"token per layer (kv_lora_rank + qk_rope_head_dim), and every rank holds all of it: {layers} layers x "
            f"{r['cached_values_per_layer']} x {dt} bytes = {r['kv_bytes_per_token_per_rank']:,} bytes per token on "
            f"each of the {r['tp']} ranks, {r['tp']}x the even split of {r['kv_bytes_per_token_even_split']:,.0f}."
        )
    head_bytes = r["cached_values_per_layer"] * dt  # a key and a value of head_dim each
    how = (
        f"{r['n_kv_heads']} KV heads over {r['tp']} ranks: {r['kv_heads_per_rank']} per rank"
        if r["kv_replicas"] == 1
        else f"{r['n_kv_heads']} KV heads for {r['tp']} ranks: each rank's {r['q_heads_per_rank']} query heads read "
        f"one KV head, which {r['kv_replicas']} ranks hold"
    )
    return (
        f"- {r['model']} at tp {r['tp']}: {how}; {layers} layers x {r['kv_heads_per_rank']} x {head_bytes} bytes (key "
        f"and value) = {r['kv_bytes_per_token_per_rank']:,} bytes per token per rank"
        + (
            f", {r['kv_replicas']}x the even split of {r['kv_bytes_per_token_even_split']:,.0f}."
            if r["kv_replicas"] > 1
            else ", exactly the even split."
        )
    )


def generated(data: list[dict]) -> dict[str, str]:
    setting = (
        f"Per rank, {SETTING['dtype']} weights and cache, decode step of batch {SETTING['batch']} at "
        f"{SETTING['seq_len']} tokens on {SETTING['hardware']} (roofline of one rank plus its all-reduces; "
        f"tp above {get_hardware(SETTING['hardware']).gpus_per_node} crosses nodes, at "
        f"{_gb(get_hardware(SETTING['hardware']).network_bandwidth)}/s per direction instead of "
        f"{_gb(get_hardware(SETTING['hardware']).link_bandwidth)}/s). The decode step counts the all-reduces' "
        "bytes only: each of the step's collectives also has a fixed latency of microseconds, which this model leaves "
        "out and which, at decode's payloads of a few kilobytes, is most of what they cost."
    )
    quoted = [
        r
        for r in data
        if (r["model"], r["tp"]) in {("llama-2-70b", 8), ("llama-2-70b", 16), ("deepseek-v3", 8)}
    ]
    return {
        "diagrams": "```\n" + "\n\n".join(diagram(*d) for d in DIAGRAMS) + "\n```",
        "table": setting + "\n\n" + table(data) + "\n\n" + "\n".join(explain(r) for r in quoted),
    }


def fill(page: str, parts: dict[str, str]) -> str:
    for name, text in parts.items():
        pattern = re.compile(rf"(<!-- generated: {name} -->\n).*?(<!-- end: {name} -->)", re.S)
        if not pattern.search(page):
            raise ValueError(f"docs/parallel.md has no '<!-- generated: {name} -->' block")
        page = pattern.sub(lambda m, text=text: m.group(1) + text + "\n" + m.group(2), page)
    return page


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " ")
    )  # the first paragraph
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "tp_table.json")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "parallel.md")
    parser.add_argument(
        "--template", type=Path, default=ROOT / "docs" / "parallel.md", help="page to fill in"
    )
    args = parser.parse_args()
    data = rows()
    write_atomic(
        args.json, json.dumps({"setting": SETTING, "rows": data}, indent=1) + "\n", ours=own_path(args.json)
    )
    write_atomic(args.doc, fill(args.template.read_text(), generated(data)), ours=own_path(args.doc))
    print(f"wrote {args.json} and {args.doc}")


if __name__ == "__main__":
    main()
