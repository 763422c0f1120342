"""The checks every model family passes against its own transformers class, with the same small random weights.

A family's test file builds a transformers model from a small config (``build``), saves it as a checkpoint, and
calls the checks: logits within 1e-4 in float32 (``check_logits``; bfloat16 within its rounding), greedy tokens
equal through attnlab's ``generate`` with the contiguous and the paged cache (``check_generate``), a left-padded batch
equal to its rows alone (``check_left_padded``), and ``attnlab convert --kv-heads`` whose result loads in the family's
transformers class with logits equal to attnlab's (``check_convert``). Prompts longer than a sliding window are
these checks with long prompts. ``check_convert_mla`` and ``deepseek_without_latent_norm`` check ``convert --to mla``:
the DeepSeek-V3 checkpoint against attnlab, and, in the exact cases, against the family's own class.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import transformers
from typer.testing import CliRunner

from attnlab.attention.norm import RMSNorm
from attnlab.cli import app
from attnlab.generate import generate
from attnlab.hf import load_causal_lm, save_deepseek

VOCAB = 97


def build(config_cls, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **fields) -> Path:
    """A transformers causal LM of ``config_cls(**fields)`` with random weights (norm gains and biases moved off
    their init, so that a wrong placement shows), saved at ``path``."""
    torch.manual_seed(seed)
    cfg = config_cls(**({"vocab_size": VOCAB} | fields))
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm gains (1 or 1 + w), biases: random, so that each one's use shows
                p.normal_(mean=0.0 if "bias" in name else float(p.mean()), std=0.2)
            else:
                p.normal_(std=0.08)
    model.to(dtype).save_pretrained(path)
    return path


def hf_model(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def tokens(n: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def check_logits(path: Path, n: int = 24, rtol: float = 1e-4, atol: float = 1e-4) -> float:
    """attnlab's logits of a batch of ``n`` tokens equal transformers'; returns the largest difference."""
    x = tokens(n)
    ours, theirs = load_causal_lm(path)(x), hf_model(path)(x).logits.float()
    torch.testing.assert_close(ours, theirs, rtol=rtol, atol=atol)
    return float((ours - theirs).abs().max())


@torch.no_grad()
def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    """transformers' greedy continuation of one prompt (its own cache)."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def check_generate(path: Path, lengths: tuple[int, ...] = (5, 9), new: int = 6) -> None:
    """Greedy tokens through attnlab's ``generate`` equal transformers', with the contiguous cache (prompts of one
    length) and the paged one (of different lengths)."""
    model, theirs = load_causal_lm(path), hf_model(path)
    prompts = [tokens(n, 1, seed=10 + n)[0].tolist() for n in lengths]
    want = [hf_greedy(theirs, p, new) for p in prompts]
    paged = generate(model, prompts, new, cache="paged")
    assert paged.cache == "paged" and paged.tokens == want, (paged.tokens, want)
    for prompt, row in zip(prompts, want, strict=True):
        alone = generate(model, [prompt, prompt], new, cache="contiguous")
        assert alone.tokens == [row, row], (alone.tokens, row)


@torch.no_grad()
def check_left_padded(path: Path, lengths: tuple[int, ...] = (4, 7)) -> None:
    """A left-padded batch (mask and position ids) gives each row the logits it has alone."""
    model = load_causal_lm(path)
    width = max(lengths)
    rows = [tokens(n, 1, seed=20 + n)[0] for n in lengths]
    batch = torch.stack([torch.cat((torch.zeros(width - len(r), dtype=torch.long), r)) for r in rows])
    real = torch.stack([torch.arange(width) >= width - len(r) for r in rows])
    positions = (real.cumsum(-1) - 1).clamp_min(0)
    mask = real[:, None, None, :] & torch.ones(width, width, dtype=torch.bool).tril()
    logits = model(batch, attn_mask=mask, position_ids=positions)
    for i, r in enumerate(rows):
        alone = model(r[None])
        torch.testing.assert_close(logits[i, width - len(r) :], alone[0], rtol=1e-4, atol=1e-4)


def convert(src: Path, dst: Path, *args) -> dict:
    result = CliRunner().invoke(app, ["convert", str(src), str(dst), *map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@torch.no_grad()
def check_convert(src: Path, dst: Path, kv_heads: int, *args) -> dict:
    """``attnlab convert --kv-heads`` (``args``: --method, --calib): the result loads in the family's transformers
    class with logits equal to attnlab's; returns the summary with the largest difference."""
    summary = convert(src, dst, "--kv-heads", kv_heads, *args)
    x = tokens(16)
    ours, theirs = load_causal_lm(dst)(x), hf_model(dst)(x).logits.float()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    return summary | {"max_logit_difference": float((ours - theirs).abs().max())}


@torch.no_grad()
def check_convert_mla(src: Path, dst: Path, *args) -> dict:
    """``attnlab convert --to mla`` (``args``: --kv-lora-rank, --rope-dim, ...): the DeepSeek-V3 checkpoint written
    loads in transformers' ``DeepseekV3ForCausalLM`` with logits equal to attnlab's; returns the summary with the
    largest difference (``written_vs_attnlab``)."""
    summary = convert(src, dst, "--to", "mla", *args)
    x = tokens(16)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    ours, logits = load_causal_lm(dst)(x), theirs(x).logits.float()
    torch.testing.assert_close(ours, logits, rtol=1e-4, atol=1e-4)
    return summary | {"written_vs_attnlab": float((ours - logits).abs().max())}


@torch.no_grad()
def deepseek_without_latent_norm(mla, path: Path, base: dict):
    """transformers' DeepseekV3ForCausalLM holding ``mla`` (a converted attnlab model, ``kv_norm=False``) through
    attnlab's export (config, rope_parameters, rotary row layout), with its latent norm bypassed: DeepSeek's latent
    norm is the one step of the export that no weights make exact (``convert.latent_norm``), measured apart. As
    tests/convert/test_convert_mla_scaled.py checks scaled RoPE."""
    native = copy.deepcopy(mla)
    for layer in native.layers:
        attn = layer.attention
        attn.cfg = attn.cfg.replace(kv_norm=True)
        attn.kv_norm = RMSNorm(attn.cfg.kv_lora_rank)  # written, then bypassed below
    native.cfg = native.cfg.with_attention(native.layers[0].attention.cfg)
    save_deepseek(native, path, base_config=base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    for layer in hf.model.layers:
        layer.self_attn.kv_a_layernorm = torch.nn.Identity()
    return hf
