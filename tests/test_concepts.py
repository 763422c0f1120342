"""docs/concepts.md cannot drift: every figure it quotes is recomputed here from ``attnlab.cost`` and the presets
(or the published figure it cites), every formula in its tables evaluates to the number beside it, every line
of our source it quotes exists, and the tutorial mistakes its pitfalls describe fail as it says they do.

A new number in the page's prose (with a decimal point or three or more digits) fails the test until it is
added to ``figures()`` (computed) or ``CITED`` (a published or configuration value, with its source).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from attnlab.config import AttentionConfig, ModelConfig
from attnlab.cost import attention_flops, get_preset, kv_cache_bytes
from attnlab.cost.hardware import HARDWARE

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "concepts.md").read_text()
PROSE = re.sub(r"```.*?```", "", PAGE, flags=re.DOTALL)

# Values the page quotes that are not computed here: configuration dims of the models it describes (their
# public config.json files), citations (arXiv ids, years, paper sections), versions, published figures.
CITED = {
    "128", "192", "256", "512", "576", "3072", "4096", "4,096", "131072", "131,072",  # model dims and lengths
    "2.1", "3.1", "3.2", "4.2", "2.13",  # paper sections (DeepSeek-V2 §2.1, §3.2; V3 §4.2), torch 2.13
    "0.05", "0.1",  # GQA paper: uptraining alpha = 0.05; YaRN's mscale = 0.1 * ln(factor) + 1
    "93.3",  # DeepSeek-V2 (arXiv 2405.04434): "reduces the KV cache by 93.3%"; recomputed below as well
}  # fmt: skip


def kib(n: int) -> str:
    return f"{n / 1024:,g} KiB"


def gib(n: int) -> str:
    return f"{n / 2**30:,.4g} GiB"


def kv(name_or_cfg, dtype: str = "bf16", seq_len: int = 1) -> int:
    cfg = get_preset(name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    return kv_cache_bytes(cfg, 1, seq_len, dtype)


def with_kv_heads(name: str, n_kv: int, head_dim: int | None = None) -> ModelConfig:
    cfg = get_preset(name)
    attn = cfg.attention
    return cfg.with_attention(
        AttentionConfig(d_model=attn.d_model, n_heads=attn.n_heads, n_kv_heads=n_kv, head_dim=head_dim)
    )


def figures() -> list[str]:
    """Every figure of the page, as the page writes it, computed."""
    out: list[str] = []
    # §2: KV cache per token in bf16
    gemma_2b = ModelConfig(vocab_size=256000, n_layers=18, ffn_dim=16384,
                           attention=AttentionConfig(d_model=2048, n_heads=8, n_kv_heads=1, head_dim=256))  # fmt: skip
    llama70_mha = with_kv_heads("llama-2-70b", 64)
    per_token = {
        "llama-2-7b": kv("llama-2-7b"), "llama-2-70b": kv("llama-2-70b"), "70b-mha": kv(llama70_mha),
        "gemma-2b": kv(gemma_2b), "deepseek-v2": kv("deepseek-v2"), "deepseek-v2-lite": kv("deepseek-v2-lite"),
        "deepseek-v3": kv("deepseek-v3"),
    }  # fmt: skip
    for n in per_token.values():
        out += [f"{n:,}", kib(n)]
    out += [gib(kv("llama-2-70b", seq_len=4096)), gib(kv(llama70_mha, seq_len=4096))]
    out += [gib(kv("llama-2-7b", seq_len=4096)), gib(kv("deepseek-v3", seq_len=131072))]
    # DeepSeek-V2's MHA comparison: 2 * n_h * d_h values per token and layer against kv_lora_rank + rope dim
    v2 = get_preset("deepseek-v2").attention
    mha_values, mla_values = 2 * v2.n_heads * v2.v_head_dim, v2.cache_dim
    out += [f"{mha_values:,}", f"{mha_values / mla_values:.1f}x", f"{mla_values / v2.v_head_dim:g}"]
    out += [f"{mla_values / (2 * v2.v_head_dim):g}", f"{kv(with_kv_heads('deepseek-v3', 128, 128)):,}"]
    # ... and the paper's 93.3% against DeepSeek 67B, with its 6-bit KV cache
    dense, v2_bf16, v2_fp6 = kv("deepseek-67b"), kv("deepseek-v2"), kv("deepseek-v2", "fp6")
    out += [
        f"{dense:,}",
        f"{100 * (1 - v2_bf16 / dense):.1f}%",
        f"{v2_fp6:,}",
        f"{100 * (1 - v2_fp6 / dense):.1f}%",
    ]
    # §3: FLOPs per token and layer
    for cfg in (
        get_preset("llama-2-7b").attention,
        get_preset("llama-2-70b").attention,
        llama70_mha.attention,
    ):
        f = attention_flops(cfg, 1, 1, 4096)
        out += [f"{f.q_proj + f.k_proj + f.v_proj + f.out_proj:,}", f"{f.scores + f.values:,}"]
    # §4: the H100's ridge point (dense bf16 over HBM bandwidth), from the hardware table's datasheet values
    h100 = HARDWARE["h100"]
    out += [f"{h100.peak_flops['bf16'] / 1e12:.0f}", f"{h100.bandwidth / 1e12:g}"]
    out += [f"{h100.peak_flops['bf16'] / h100.bandwidth:.0f}"]
    # §5: MLA per cached token and head (V2-Lite and V3 share the attention dims), from the FLOP model
    lite, v3 = get_preset("deepseek-v2-lite").attention, get_preset("deepseek-v3").attention

    def per_cached_token(cfg, mode: str) -> float:  # the part of one decode step that grows with the context
        a, b = (attention_flops(cfg.replace(mode=mode), 1, 1, n) for n in (1, 2))
        return (b.total - a.total) / cfg.n_heads

    naive, absorbed = per_cached_token(lite, "naive"), per_cached_token(lite, "absorbed")
    materialised = 2 * lite.qk_head_dim + 2 * lite.v_head_dim
    row_bytes = kv_cache_bytes(lite, 1, 1, "bf16")
    absorb = attention_flops(lite.replace(mode="absorbed"), 1, 1, 1).absorb / lite.n_heads / 2
    out += [f"{naive:,.0f}", f"{materialised:,}", f"{absorbed:,.0f}", f"{row_bytes:,}", f"{absorb:,.0f}"]
    out += [f"{(lite.qk_head_dim + lite.v_head_dim) * 2:,}"]  # bytes per head of materialised K/V in bf16
    for cfg in (lite, v3):
        h = cfg.n_heads
        out += [f"{absorbed * h:,.0f}", f"{absorbed * h / row_bytes:.1f}", f"{materialised * h:,}"]
        out += [f"{naive * h:,.0f}", f"{materialised * h / row_bytes:.0f}x"]
    out += [
        f"{absorbed / materialised:.1f}x",
        f"{naive / absorbed:.0f}x",
        f"{materialised * lite.n_heads / row_bytes:.1f}x",
    ]
    out += [f"{absorbed * v3.n_heads / row_bytes:.0f}", f"{absorbed * lite.n_heads / row_bytes:.0f}"]
    # §5: the fewest new tokens for which mode "auto" decompresses (naive) over a long cache, DeepSeek-V3's dims
    auto, held = v3.replace(mode="auto"), 10**7
    out += [str(next(t for t in range(1, 10**4) if auto.mode_for(t, kv_len=held + t) == "naive"))]
    conversion = auto.replace(kv_lora_rank=320, qk_nope_head_dim=64, v_head_dim=64)  # docs/performance.md's
    out += [str(next(t for t in range(1, 10**4) if conversion.mode_for(t, kv_len=held + t) == "naive"))]
    # §6: DeepSeek-V3's YaRN factor 40 (its config.json): softmax scale times mscale^2
    out += [f"{(0.1 * math.log(40) + 1) ** 2:.3f}"]
    # §9: Gemma-7B with the wrong head_dim, and GQA's K/V width
    gemma_7b = {hd: 2 * 28 * 16 * hd * 2 for hd in (3072 // 16, 256)}
    out += [kib(n) for n in gemma_7b.values()]
    out += [f"{get_preset('llama-2-70b').attention.n_kv_heads * 128:,}"]
    return out


def prose_numbers() -> set[str]:
    """Numbers of the page's prose (code blocks and inline code aside) that need a source: a decimal point or
    three or more digits."""
    text = re.sub(r"`[^`\n]*`", "", PROSE)
    found = re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?", text)
    return {n.rstrip(",") for n in found if "." in n or len(n.replace(",", "")) >= 3}


def test_every_computed_figure_is_on_the_page():
    missing = [f for f in figures() if f not in PAGE]
    assert not missing, missing


def test_every_figure_on_the_page_is_computed_or_cited():
    arxiv = re.compile(r"\d{4}\.\d{5}")  # arXiv ids
    years = {str(y) for y in range(2009, 2030)}
    known = set(CITED) | years
    for fig in figures():
        known |= set(re.findall(r"\d[\d,]*(?:\.\d+)?", fig))
    unknown = sorted(n for n in prose_numbers() if n not in known and not arxiv.fullmatch(n))
    assert not unknown, f"figures on docs/concepts.md that nothing computes or cites: {unknown}"


def test_table_formulas_equal_the_figure_beside_them():
    rows = re.findall(r"\|\s*`([\d*+/() .-]+)`\s*\|\s*\**([\d,]+)", PAGE)
    assert len(rows) >= 7
    for expr, value in rows:
        assert eval(expr) == int(value.replace(",", "")), (
            expr,
            value,
        )  # the pattern admits digits and operators only


def quoted_lines() -> list[tuple[str, str]]:
    """(file, line) for every line of a Python block that follows a mention of one of our source files."""
    out, current = [], None
    for part in re.split(r"(```python\n.*?```)", PAGE, flags=re.DOTALL):
        if part.startswith("```python"):
            assert current is not None, part
            out += [(current, line) for line in part.splitlines()[1:-1] if line.strip()]
        else:
            mentions = re.findall(r"`(src/attnlab/[\w/]+\.py)`", part)
            current = mentions[-1] if mentions else current
    return out


def test_quoted_source_lines_exist():
    quoted = quoted_lines()
    assert len(quoted) >= 20
    for path, line in quoted:
        assert line in (ROOT / path).read_text().splitlines(), (path, line)


def test_the_tutorial_mistakes_fail_as_described():
    import torch.nn.functional as F

    assert not hasattr(F, "matmul") and not hasattr(torch, "mutmul")
    x = torch.randn(2, 3)
    with pytest.raises(TypeError):
        nn.Softmax(x, dim=-1)
    y = torch.randn(2, 4, 5, 8).transpose(1, 2)  # (B, T, H, D), not contiguous
    with pytest.raises(RuntimeError, match="view"):
        y.view(2, 5, -1)
    assert torch.equal(y.reshape(2, 5, 32), y.contiguous().view(2, 5, 32))
    # q.view(B, n_rep, G, ...) pairs query head h with KV head h % G; the right split is (G, n_rep).
    b, n_kv, n_rep = 1, 2, 3
    heads = torch.arange(n_kv * n_rep).view(1, -1, 1, 1).expand(b, -1, 1, 1)
    wrong = heads.reshape(b, n_rep, n_kv, 1, 1)[0, :, :, 0, 0]  # [r, g] -> query head
    right = heads.reshape(b, n_kv, n_rep, 1, 1)[0, :, :, 0, 0]  # [g, r] -> query head
    assert [h // n_rep for h in right[1].tolist()] == [1, 1, 1]  # KV head 1 reads query heads 3, 4, 5
    assert [h % n_kv for h in wrong[:, 1].tolist()] == [1, 1, 1] and wrong[:, 1].tolist() == [1, 3, 5]
