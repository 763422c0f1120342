"""Hugging Face modules with attnlab's weights and cache contents: the baselines of the decode benchmark.

``llama_attention(attn)`` builds ``transformers``' ``LlamaAttention`` (sdpa) from a ``GroupedQueryAttention``;
``deepseek_attention(mla)`` builds ``DeepseekV3Attention`` from a ``MultiHeadLatentAttention``. Each returns a
``step(x)`` callable doing one decode step through a ``DynamicCache`` filled with the same keys/values (or latents)
as attnlab's cache, and a ``crop()`` that drops the step's token again. Both use half-split RoPE as attnlab
does, so outputs are comparable. ``timed_generate(hf, prompt, new)`` times transformers' own greedy ``generate``
(the end-to-end baselines of benchmarks/generate.py and benchmarks/gpu_check.py). transformers is imported here
only (an optional dependency).
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable

import torch

from ..attention.gqa import GroupedQueryAttention
from ..attention.mla import MultiHeadLatentAttention
from ..hf_config import attention_to_hf


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub: everything here is built locally
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - transformers is in the test extra
        raise ValueError("the Hugging Face baselines need transformers: pip install 'attnlab[test]'") from err
    return transformers


def _cache_name(module: torch.nn.Module) -> str:
    """The keyword an attention module of this transformers takes its cache by: ``cache`` in 5.x (where
    ``past_key_values`` warns, and goes in 5.40), ``past_key_values`` before, ``past_key_value`` in 4.4x."""
    params = inspect.signature(module.forward).parameters
    return next((name for name in ("cache", "past_key_values", "past_key_value") if name in params), "cache")


def _crop(cache, length: int) -> None:
    """Drop the tokens a timed step appended (DynamicCache.crop takes a negative count to remove)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def llama_attention(
    attn: GroupedQueryAttention, k: torch.Tensor, v: torch.Tensor
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], None]]:
    """HF ``LlamaAttention`` (sdpa) with ``attn``'s weights; its cache holds ``k``, ``v`` (B, n_kv, S, D)."""
    tf = _transformers()
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    cfg = attn.cfg
    hf_cfg = tf.LlamaConfig(
        **attention_to_hf(cfg), attention_bias=cfg.bias, max_position_embeddings=max(4096, 2 * k.shape[2])
    )
    hf_cfg._attn_implementation = "sdpa"
    weight = attn.wq.weight
    hf = LlamaAttention(hf_cfg, layer_idx=0).to(dtype=weight.dtype, device=weight.device).eval()
    for ours, theirs in (
        (attn.wq, hf.q_proj),
        (attn.wk, hf.k_proj),
        (attn.wv, hf.v_proj),
        (attn.wo, hf.o_proj),
    ):
        theirs.weight.data.copy_(ours.weight.data)
        if ours.bias is not None:
            theirs.bias.data.copy_(ours.bias.data)
    rotary = LlamaRotaryEmbedding(hf_cfg).to(weight.device)
    cache = tf.DynamicCache(config=hf_cfg)
    cache.update(k.clone(), v.clone(), 0)
    context = k.shape[2]

    def step(x: torch.Tensor) -> torch.Tensor:
        position_ids = torch.full((x.shape[0], 1), context, dtype=torch.long, device=x.device)
        cos_sin = rotary(x, position_ids)
        # No mask: a single new token may see every cached one, and HF's sdpa path then uses enable_gqa.
        return hf(x, position_embeddings=cos_sin, attention_mask=None, **{_cache_name(hf): cache})[0]

    return step, lambda: _crop(cache, context)


def deepseek_attention(
    mla: MultiHeadLatentAttention, rows: torch.Tensor
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], None]]:
    """HF ``DeepseekV3Attention`` with ``mla``'s weights; its cache holds ``rows`` (B, S, kv_lora_rank + rope)."""
    tf = _transformers()
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    cfg = mla.cfg
    hf_cfg = tf.DeepseekV3Config(
        **attention_to_hf(cfg),
        rope_interleave=False,  # attnlab's half-split layout
        max_position_embeddings=max(4096, 2 * rows.shape[1]),
        rms_norm_eps=mla.kv_norm.eps if hasattr(mla.kv_norm, "eps") else 1e-6,
    )
    hf_cfg._attn_implementation = "sdpa"
    weight = mla.wkv_a.weight
    hf = DeepseekV3Attention(hf_cfg, layer_idx=0).to(dtype=weight.dtype, device=weight.device).eval()
    pairs = [(mla.wkv_a, hf.kv_a_proj_with_mqa), (mla.wkv_b, hf.kv_b_proj), (mla.wo, hf.o_proj)]
    if cfg.q_lora_rank:
        pairs += [(mla.wq_a, hf.q_a_proj), (mla.q_norm, hf.q_a_layernorm), (mla.wq_b, hf.q_b_proj)]
    else:
        pairs.append((mla.wq, hf.q_proj))
    pairs.append((mla.kv_norm, hf.kv_a_layernorm))
    for ours, theirs in pairs:
        theirs.weight.data.copy_(ours.weight.data)
        if getattr(ours, "bias", None) is not None:
            theirs.bias.data.copy_(ours.bias.data)
    rotary = DeepseekV3RotaryEmbedding(hf_cfg).to(weight.device)
    cache = tf.DynamicCache(config=hf_cfg)
    b, s, _ = rows.shape
    latent, k_rope = rows.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    cache.update(latent.reshape(b, 1, s, -1).clone(), k_rope.reshape(b, 1, s, -1).clone(), 0)

    def step(x: torch.Tensor) -> torch.Tensor:
        position_ids = torch.full((x.shape[0], 1), s, dtype=torch.long, device=x.device)
        cos_sin = rotary(x, position_ids)
        return hf(x, position_embeddings=cos_sin, attention_mask=None, **{_cache_name(hf): cache})[0]

    return step, lambda: _crop(cache, s)


def timed_generate(hf, prompt: list[int], new: int, **options) -> dict:
    """transformers' greedy ``hf.generate`` of ``new`` tokens after ``prompt`` (one row, on the model's device), its
    time stamped by a logits processor at every step, the device synchronised first: the new tokens, the seconds
    from the call to the first token (``prefill_s``) and from the first to the last (``decode_s``, ``new - 1``
    steps). ``options`` go to ``generate`` (e.g. ``cache_implementation="static"``)."""
    transformers = _transformers()
    device = hf.device
    stamps: list[float] = []

    class Clock(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor([prompt], device=device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
            logits_processor=transformers.LogitsProcessorList([Clock()]), **options,
        )  # fmt: skip
    return {
        "tokens": out[0, len(prompt) :].tolist(),
        "prefill_s": stamps[0] - start,
        "decode_s": stamps[-1] - stamps[0],
    }
