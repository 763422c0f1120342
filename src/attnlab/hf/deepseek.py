"""Dense DeepSeek-V3 checkpoints (Hugging Face ``DeepseekV3ForCausalLM``) <-> ``attnlab.model.Transformer`` (MLA).

The conversion is a key map plus one named transform. Keys (N = layer index):

    model.embed_tokens.weight                        tok_embeddings.weight
    model.layers.N.self_attn.q_proj                  layers.N.attention.wq                (q_lora_rank null)
    model.layers.N.self_attn.q_a_proj / q_a_layernorm / q_b_proj   attention.wq_a / q_norm / wq_b
    model.layers.N.self_attn.kv_a_proj_with_mqa      layers.N.attention.wkv_a             (.weight, .bias)
    model.layers.N.self_attn.kv_a_layernorm          layers.N.attention.kv_norm
    model.layers.N.self_attn.kv_b_proj               layers.N.attention.wkv_b
    model.layers.N.self_attn.o_proj                  layers.N.attention.wo                (.weight, .bias)
    model.layers.N.{input,post_attention}_layernorm, mlp.{gate,down,up}_proj, model.norm, lm_head: as Llama.

RoPE layout: with ``rope_interleave`` (DeepSeek's default, and what serving engines assume) transformers reads
the rotary rows of each query head and of the shared rotary key as interleaved pairs (2j, 2j+1); attnlab rotates
half-split pairs (j, j + qk_rope_head_dim/2). The rotary rows (the last ``qk_rope_head_dim`` of each head in
``q_proj``/``q_b_proj``, the last ``qk_rope_head_dim`` of ``kv_a_proj_with_mqa``) are permuted by
``interleaved_to_half_split`` on import and back on export; ``rope_interleave: false`` maps them unchanged.

Only dense models: every layer's MLP must be the dense one (``first_k_dense_replace`` >= layers, or no routed
experts), RoPE must be plain (no yarn: its mscale would change the softmax scale), and ``num_key_value_heads``
must equal ``num_attention_heads`` (transformers repeats MLA's per-head keys by their ratio). The softmax scale
is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`` on both sides. Written checkpoints declare zero routed
experts and ``first_k_dense_replace`` = layers, so no engine builds a mixture of experts.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..attention.rope import interleaved_to_half_split
from ..config import MLAConfig, ModelConfig
from ..hf_config import from_hf_config, to_hf_config
from ..model import Transformer
from . import io
from .llama import _LAYER_MAP, attnlab_to_hf_key, check_default_rope, hf_to_attnlab_key, model_from_state

ARCHITECTURE = "DeepseekV3ForCausalLM"
_LAYER = {k: v for k, v in _LAYER_MAP.items() if not k.startswith("self_attn.")} | {
    "self_attn.q_proj": "attention.wq",
    "self_attn.q_a_proj": "attention.wq_a",
    "self_attn.q_a_layernorm": "attention.q_norm",
    "self_attn.q_b_proj": "attention.wq_b",
    "self_attn.kv_a_proj_with_mqa": "attention.wkv_a",
    "self_attn.kv_a_layernorm": "attention.kv_norm",
    "self_attn.kv_b_proj": "attention.wkv_b",
    "self_attn.o_proj": "attention.wo",
}
# Fields a converted checkpoint keeps from its source's config.json (tokens, dtype); the rest is DeepSeek's.
CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype", "initializer_range")


def model_config_from_deepseek(hf: dict) -> ModelConfig:
    """The ``ModelConfig`` of a dense DeepSeek-V3 config.json (a dict), after the checks an exact load needs."""
    if hf.get("model_type") != "deepseek_v3":
        raise ValueError(f"model_type must be 'deepseek_v3', got {hf.get('model_type')!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"config.json hidden_act={hf.get('hidden_act')!r}: only 'silu' (SwiGLU) is supported"
        )
    check_default_rope(hf)
    n_layers, n_heads = hf.get("num_hidden_layers"), hf.get("num_attention_heads")
    if hf.get("n_routed_experts") and (hf.get("first_k_dense_replace") or 0) < (n_layers or 0):
        raise ValueError(
            f"config.json has MoE layers (n_routed_experts={hf['n_routed_experts']}, first_k_dense_replace="
            f"{hf.get('first_k_dense_replace')} < num_hidden_layers={n_layers}); attnlab.model builds dense models only"
        )
    if hf.get("num_key_value_heads") not in (None, n_heads):
        raise ValueError(
            f"config.json num_key_value_heads={hf['num_key_value_heads']} must equal num_attention_heads={n_heads} "
            "for MLA (transformers repeats the per-head keys by their ratio)"
        )
    if not isinstance(hf.get("rope_interleave", True), bool):
        raise ValueError(f"config.json rope_interleave must be true or false, got {hf['rope_interleave']!r}")
    return from_hf_config(hf)


def hf_config_from_model(cfg: ModelConfig, base: dict | None = None, rope_interleave: bool = True) -> dict:
    """A dense DeepSeek-V3 config.json dict for ``cfg`` (MLA attention with its latent norm), carrying the
    ``CARRIED`` fields of ``base`` (e.g. the Llama source's token ids)."""
    attn = cfg.attention
    if not isinstance(attn, MLAConfig):
        raise ValueError("only MLA models can be written as DeepSeek-V3 checkpoints; this one has GQA/MHA")
    if not attn.kv_norm:
        raise ValueError(
            "MLAConfig.kv_norm=False: a DeepSeek-V3 checkpoint always normalises the latent (kv_a_layernorm); "
            "add the norm first with attnlab.convert.fold_latent_norms"
        )
    if cfg.mlp != "swiglu" or cfg.mlp_bias or cfg.is_moe:
        raise ValueError(
            f"DeepSeek-V3's dense MLP is SwiGLU without bias; got mlp={cfg.mlp!r}, mlp_bias={cfg.mlp_bias}, "
            f"n_experts={cfg.n_experts}"
        )
    hf = {k: base[k] for k in CARRIED if base and k in base}
    hf.update(
        model_type="deepseek_v3",
        architectures=[ARCHITECTURE],
        **to_hf_config(cfg),
        rope_interleave=rope_interleave,
        # Dense: no routed or shared experts, every layer below first_k_dense_replace.
        first_k_dense_replace=cfg.n_layers,
        n_routed_experts=0,
        n_shared_experts=0,
        num_experts_per_tok=0,
        moe_intermediate_size=0,
        n_group=1,
        topk_group=1,
        num_nextn_predict_layers=0,
    )
    return hf


def permute_rotary_rows(name: str, value: torch.Tensor, attn: MLAConfig, to_half_split: bool) -> torch.Tensor:
    """The RoPE layout transform of one attnlab tensor: its rotary rows reordered between DeepSeek's
    interleaved pairs and attnlab's half-split pairs (other tensors are returned unchanged)."""
    perm = interleaved_to_half_split(attn.qk_rope_head_dim)
    if not to_half_split:
        perm = torch.argsort(perm)
    if re.search(r"attention\.(wq|wq_b)\.weight$", name):  # (n_heads * qk_head_dim, in): each head's tail
        heads = value.reshape(attn.n_heads, attn.qk_head_dim, -1).clone()
        heads[:, attn.qk_nope_head_dim :] = heads[:, attn.qk_nope_head_dim :][:, perm]
        return heads.reshape(value.shape)
    if re.search(r"attention\.wkv_a\.(weight|bias)$", name):  # (kv_lora_rank + qk_rope_head_dim, ...)
        out = value.clone()
        out[attn.kv_lora_rank :] = value[attn.kv_lora_rank :][perm]
        return out
    return value


def state_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig, rope_interleave: bool = True) -> dict:
    """attnlab state dict from DeepSeek-V3 tensors (``load_deepseek`` checks its key set against the model)."""
    state = {}
    for key, value in tensors.items():
        name = hf_to_attnlab_key(key, _LAYER, "dense DeepSeek-V3")
        if name is None:
            continue
        state[name] = permute_rotary_rows(name, value, cfg.attention, True) if rope_interleave else value
    if cfg.tie_embeddings:
        state.setdefault("output.weight", state.get("tok_embeddings.weight"))
    return state


def state_to_hf(model: Transformer, rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 tensors of an attnlab MLA model (``lm_head`` omitted when embeddings are tied)."""
    return state_dict_to_hf(model.state_dict(), model.cfg, rope_interleave)


def state_dict_to_hf(
    state: dict[str, torch.Tensor], cfg: ModelConfig, rope_interleave: bool = True
) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 tensors of an attnlab MLA state dict (e.g. gathered from a sharded model) of config ``cfg``."""
    out = {}
    for name, value in state.items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        value = value.detach()
        if rope_interleave:
            value = permute_rotary_rows(name, value, cfg.attention, False)
        out[attnlab_to_hf_key(name, _LAYER)] = value.clone()
    return out


def load_deepseek(src: str | Path) -> Transformer:
    """An attnlab ``Transformer`` (MLA) holding a dense DeepSeek-V3 checkpoint (weights keep their dtype)."""
    hf = io.read_config(src)
    cfg = model_config_from_deepseek(hf)
    tensors, _ = io.read_tensors(src)
    return model_from_state(src, cfg, state_from_hf(tensors, cfg, hf.get("rope_interleave", True)))


def save_deepseek(
    model: Transformer,
    dst: str | Path,
    *,
    base_config: dict | None = None,
    rope_interleave: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write an MLA ``model`` (with its latent norm) as a dense DeepSeek-V3 checkpoint directory, atomically;
    returns ``dst``. ``base_config``: the source's config.json, whose token ids and dtype are kept."""
    hf = hf_config_from_model(model.cfg, base_config, rope_interleave)
    tensors = state_to_hf(model, rope_interleave)
    with io.atomic_dir(dst, overwrite) as tmp:
        io.write_tensors(tmp, tensors)
        io.write_config(tmp, hf)
    return Path(dst)
