"""DeepSeek-V2/V3 (multi-head latent attention, DeepSeekMoE): read for the cost model; dense DeepSeek-V3 checkpoints
(what ``attnlab convert --to mla`` writes) loaded and written as ``DeepseekV3ForCausalLM``.

Tensor names (N = layer index); the MLP, norms, embeddings and head are Llama's:

    model.layers.N.self_attn.q_proj                  layers.N.attention.wq                (q_lora_rank null)
    model.layers.N.self_attn.q_a_proj / q_a_layernorm / q_b_proj   attention.wq_a / q_norm / wq_b
    model.layers.N.self_attn.kv_a_proj_with_mqa      layers.N.attention.wkv_a             (.weight, .bias)
    model.layers.N.self_attn.kv_a_layernorm          layers.N.attention.kv_norm
    model.layers.N.self_attn.kv_b_proj               layers.N.attention.wkv_b
    model.layers.N.self_attn.o_proj                  layers.N.attention.wo                (.weight, .bias)

RoPE layout: with ``rope_interleave`` (DeepSeek's default, and what serving engines assume) transformers reads the
rotary rows of each query head and of the shared rotary key as interleaved pairs (2j, 2j+1); attnlab rotates
half-split pairs (j, j + qk_rope_head_dim/2). The rotary rows (the last ``qk_rope_head_dim`` of each head in
``q_proj``/``q_b_proj``, the last ``qk_rope_head_dim`` of ``kv_a_proj_with_mqa``) are permuted by the transform
``deepseek_rope_rows`` on import and back on export; ``rope_interleave: false`` maps them unchanged.

Loading takes dense models only (``first_k_dense_replace`` >= layers, or no routed experts), plain RoPE (yarn's
mscale would change the softmax scale) and ``num_key_value_heads`` equal to ``num_attention_heads`` (transformers
repeats MLA's per-head keys by their ratio). The softmax scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``.
Written checkpoints declare a dense model: ``first_k_dense_replace`` = layers, zero routed experts.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import MLAConfig, ModelConfig
from .base import _MISSING, Family, Fields, MLASupport, Rule, TensorMap, Transform, mlp_obstacle
from .llama import LAYER_RULES, TOP_RULES, decoder_rules

ARCHITECTURE = "DeepseekV3ForCausalLM"
# Fields a converted checkpoint keeps from its source's config.json (tokens, dtype); the rest is DeepSeek's.
CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype", "initializer_range")


# What a dense model's config.json says about experts, decided by the loaders that read it (llama.cpp build 11434,
# transformers 5.x, vLLM's deepseek_v2.py); ``first_k_dense_replace`` = layers is written beside these.
# - first_k_dense_replace = num_hidden_layers: every layer is dense. transformers builds the MoE MLP only for
#   ``layer_idx >= config.first_k_dense_replace`` (DeepseekV3DecoderLayer); vLLM's DeepseekV2DecoderLayer likewise
#   (``is_moe_layer``); llama.cpp's converter writes it as ``leading_dense_block_count`` and deepseek2.cpp gives
#   layers below it the dense FFN.
# - n_routed_experts = 0, n_shared_experts = 0, moe_intermediate_size = 0: transformers' DeepseekV3Config types
#   them ``int`` (null fails its strict validation). llama.cpp's converter writes n_routed_experts as the expert
#   count (0: llama-model.cpp then asserts no experts are used and no expert groups exist), and always writes
#   n_shared_experts and moe_intermediate_size (deepseek2.cpp requires both keys).
# - num_experts_per_tok, n_group, topk_group, norm_topk_prob = null: typed ``int | None`` by transformers; llama.cpp's
#   converter writes each only when not null (conversion/base.py, set_gguf_parameters), and llama-model.cpp asserts
#   ``n_expert_groups == 0`` when there are no experts: ``n_group: 1`` makes llama.cpp refuse the model.
# - routed_scaling_factor = 1.0: vLLM divides a dense layer's float16 output by it (its overflow guard), and
#   transformers' default is 2.5; 1.0 is the neutral value (llama.cpp reads it only for experts).
# - num_nextn_predict_layers = 0 and num_mtp_layers = 0: no multi-token-prediction layers, under DeepSeek's name
#   (llama.cpp's converter and vLLM's speculative-decoding path read it) and transformers 5's (DeepseekV3Config's
#   num_mtp_layers defaults to 1, which its MTP candidate generator would look for).
DENSE_FIELDS: dict[str, Any] = dict(
    n_routed_experts=0,
    n_shared_experts=0,
    moe_intermediate_size=0,
    num_experts_per_tok=None,
    n_group=None,
    topk_group=None,
    norm_topk_prob=None,
    routed_scaling_factor=1.0,
    num_nextn_predict_layers=0,
    num_mtp_layers=0,
)


# What a field left out of config.json means to transformers' DeepseekV2Config and DeepseekV3Config (5.x), where
# attnlab read something else (uncompressed queries, no experts, positions 4096): compressed queries, routed and
# shared experts after the first dense layers. A null q_lora_rank is uncompressed queries in both (V2-Lite).
_ABSENT = {
    "deepseek_v2": dict(q_lora_rank=1536, n_routed_experts=64, n_shared_experts=2, first_k_dense_replace=0,
                        moe_intermediate_size=1407, max_position_embeddings=2048),
    "deepseek_v3": dict(q_lora_rank=1536, n_routed_experts=256, n_shared_experts=1, first_k_dense_replace=3,
                        moe_intermediate_size=2048, num_experts_per_tok=8, max_position_embeddings=4096),
}  # fmt: skip


def _absent(f: Fields, key: str, fallback: Any = _MISSING) -> Any:
    """What transformers reads for ``key`` when config.json leaves it out (``fallback`` for another model_type)."""
    return _ABSENT.get(f.model_type, {}).get(key, fallback)


def read(f: Fields) -> ModelConfig:
    """DeepSeek-V2/V3: MLA (``kv_lora_rank``, ``q_lora_rank``, rope/nope/v head dims) and DeepSeekMoE."""
    d = f.int("hidden_size")
    theta, _ = f.rope()  # the cost model needs no frequencies; loading refuses scaled RoPE (check_load)
    # null: queries are not compressed (V2-Lite); left out, transformers' default
    q_rank = f.opt_int("q_lora_rank") if "q_lora_rank" in f.raw else _absent(f, "q_lora_rank", 0)
    attention = MLAConfig(
        d_model=d,
        n_heads=f.int("num_attention_heads"),
        kv_lora_rank=f.int("kv_lora_rank"),
        qk_nope_head_dim=f.int("qk_nope_head_dim", minimum=0),
        qk_rope_head_dim=f.int("qk_rope_head_dim"),
        v_head_dim=f.int("v_head_dim"),
        q_lora_rank=q_rank or 0,
        rope_theta=theta,
        bias=f.bool("attention_bias", False),
    )
    n_layers = f.layers("num_hidden_layers")
    moe: dict[str, int] = {}
    # transformers builds an MoE MLP in the layers from first_k_dense_replace on (layer_idx >= it): one covering
    # every layer (what attnlab writes), or more, is a dense model
    if "n_routed_experts" in f.raw:
        n_experts = f.opt_int("n_routed_experts", minimum=0)
    else:
        n_experts = _absent(f, "n_routed_experts", None)
    first_dense = f.int("first_k_dense_replace", _absent(f, "first_k_dense_replace", 0), minimum=0)
    if n_experts == 0 and first_dense < n_layers:
        f.fail(
            f"n_routed_experts=0 with first_k_dense_replace={first_dense} of num_hidden_layers={n_layers}: "
            "transformers builds MoE layers of shared experts alone, which attnlab does not model (a dense model "
            "sets first_k_dense_replace to num_hidden_layers)"
        )
    if n_experts and first_dense < n_layers:
        if f.int("moe_layer_freq", 1) != 1:
            f.unsupported("moe_layer_freq", "only 1: every layer after the dense ones")
        n_active = f.int("num_experts_per_tok", _absent(f, "num_experts_per_tok"))
        if n_active > n_experts:
            f.fail(f"num_experts_per_tok={n_active} exceeds n_routed_experts={n_experts}")
        moe = dict(
            n_experts=n_experts,
            n_shared_experts=f.int("n_shared_experts", _absent(f, "n_shared_experts", 0), minimum=0),
            n_active_experts=n_active,
            moe_ffn_dim=f.int("moe_intermediate_size", _absent(f, "moe_intermediate_size")),
            n_dense_layers=first_dense,
        )
    return ModelConfig(
        vocab_size=f.int("vocab_size"),
        n_layers=n_layers,
        attention=attention,
        ffn_dim=f.int("intermediate_size"),
        max_seq_len=f.int("max_position_embeddings", _absent(f, "max_position_embeddings", 4096)),
        norm_eps=f.eps("rms_norm_eps", 1e-6),
        tie_embeddings=f.bool("tie_word_embeddings", False),
        **moe,
    )


def check_load(f: Fields) -> None:
    """What a dense MLA ``attnlab.model`` cannot compute exactly (see the module docstring)."""
    if f.raw.get("hidden_act", "silu") != "silu":
        f.unsupported("hidden_act", "the MLP is SwiGLU: only 'silu'")
    if f.rope()[1]:
        f.unsupported("rope_parameters", "only plain RoPE: yarn's mscale changes the softmax scale")
    n_heads = f.raw.get("num_attention_heads")
    if f.raw.get("num_key_value_heads") not in (None, n_heads):
        f.fail(
            f"num_key_value_heads={f.raw['num_key_value_heads']} must equal num_attention_heads={n_heads} for MLA "
            "(transformers repeats the per-head keys by their ratio)"
        )
    if not isinstance(f.raw.get("rope_interleave", True), bool):
        f.fail(f"rope_interleave must be true or false, got {f.raw['rope_interleave']!r}")
    cfg = read(f)
    if cfg.is_moe:  # the routed experts' tensors would be refused one by one, by name, with no reason
        left_out = "" if "n_routed_experts" in f.raw else " (left out: transformers' default)"
        f.fail(
            f"n_routed_experts={cfg.n_experts}{left_out} is not supported (first_k_dense_replace="
            f"{cfg.n_dense_layers} of {cfg.n_layers} layers are dense: attnlab loads dense DeepSeek-V3 models only; "
            "the cost model reads this one: attnlab compare --model)"
        )


def write(cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
    """A dense DeepSeek-V3 config.json for ``cfg`` (MLA attention with its latent norm), carrying the ``CARRIED``
    fields of ``base`` (the source's token ids and dtype) and its ``rope_interleave`` (default true)."""
    attn = cfg.attention
    if not isinstance(attn, MLAConfig):
        raise ValueError("only MLA models can be written as DeepSeek-V3 checkpoints; this one has GQA/MHA")
    if not attn.kv_norm:
        raise ValueError(
            "MLAConfig.kv_norm=False: a DeepSeek-V3 checkpoint always normalises the latent (kv_a_layernorm); "
            "add the norm first with attnlab.convert.fold_latent_norms"
        )
    obstacle = mlp_obstacle(cfg)
    if obstacle:
        raise ValueError(obstacle)
    hf = {k: base[k] for k in CARRIED if k in base}
    hf.update(
        model_type="deepseek_v3",
        architectures=[ARCHITECTURE],
        hidden_size=attn.d_model,
        num_attention_heads=attn.n_heads,
        rope_parameters={"rope_type": "default", "rope_theta": attn.rope_theta},
        num_key_value_heads=attn.n_heads,  # transformers repeats MLA's per-head keys by this ratio: 1
        q_lora_rank=attn.q_lora_rank or None,
        kv_lora_rank=attn.kv_lora_rank,
        qk_nope_head_dim=attn.qk_nope_head_dim,
        qk_rope_head_dim=attn.qk_rope_head_dim,
        v_head_dim=attn.v_head_dim,
        attention_bias=attn.bias,
        num_hidden_layers=cfg.n_layers,
        intermediate_size=cfg.ffn_dim,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        hidden_act="silu",
        tie_word_embeddings=cfg.tie_embeddings,
        rope_interleave=base.get("rope_interleave", True)
        if base.get("model_type") == "deepseek_v3"
        else True,
        **DENSE_FIELDS,
        first_k_dense_replace=cfg.n_layers,
    )
    return hf


def _rope_rows(head_rows: bool, to_half: bool):
    """Permute the rotary rows of a DeepSeek tensor between interleaved pairs (the checkpoint) and half-split ones
    (attnlab): each head's last ``qk_rope_head_dim`` rows (``head_rows``: q_proj, q_b_proj), or the last
    ``qk_rope_head_dim`` rows of the latent projection (kv_a_proj_with_mqa)."""

    def permute(
        parts: list[torch.Tensor] | torch.Tensor, cfg: ModelConfig
    ) -> list[torch.Tensor] | torch.Tensor:
        value = parts[0] if isinstance(parts, list) else parts
        attn = cfg.attention
        d_rope = attn.qk_rope_head_dim
        perm = torch.cat((torch.arange(0, d_rope, 2), torch.arange(1, d_rope, 2)))
        if not to_half:
            perm = torch.argsort(perm)
        if head_rows:
            heads = value.reshape(attn.n_heads, attn.qk_head_dim, *value.shape[1:]).clone()
            heads[:, attn.qk_nope_head_dim :] = heads[:, attn.qk_nope_head_dim :][:, perm]
            out = heads.reshape(value.shape)
        else:
            out = value.clone()
            out[attn.kv_lora_rank :] = value[attn.kv_lora_rank :][perm]
        return out if isinstance(parts, list) else [out]

    return permute


def _rope_transform(head_rows: bool) -> Transform:
    name = "deepseek_rope_rows_" + ("heads" if head_rows else "latent")
    return Transform(
        name, split=_rope_rows(head_rows, to_half=True), merge=_rope_rows(head_rows, to_half=False)
    )


_ATTENTION = (
    ("self_attn.q_proj", "attention.wq", True),
    ("self_attn.q_a_proj", "attention.wq_a", None),
    ("self_attn.q_a_layernorm", "attention.q_norm", None),
    ("self_attn.q_b_proj", "attention.wq_b", True),
    ("self_attn.kv_a_proj_with_mqa", "attention.wkv_a", False),
    ("self_attn.kv_a_layernorm", "attention.kv_norm", None),
    ("self_attn.kv_b_proj", "attention.wkv_b", None),
    ("self_attn.o_proj", "attention.wo", None),
)
_OTHERS = tuple((theirs, ours) for theirs, ours in LAYER_RULES if not theirs.startswith("self_attn."))


def tensors(interleave: bool) -> TensorMap:
    """The DeepSeek-V3 tensor map; ``interleave``: the checkpoint's rotary rows are interleaved pairs."""
    rules = []
    for theirs, ours, head_rows in _ATTENTION:
        if interleave and head_rows is not None:  # weights (and the latent projection's bias) are permuted
            transform = _rope_transform(head_rows)
            rules.append(
                Rule(f"model.layers.{{i}}.{theirs}.weight", (f"layers.{{i}}.{ours}.weight",), transform)
            )
            bias_transform = transform if not head_rows else None
            rules.append(
                Rule(f"model.layers.{{i}}.{theirs}.bias", (f"layers.{{i}}.{ours}.bias",), bias_transform)
            )
        else:
            rules.append(Rule(f"model.layers.{{i}}.{theirs}.{{p}}", (f"layers.{{i}}.{ours}.{{p}}",)))
    return TensorMap((*rules, *decoder_rules(_OTHERS, TOP_RULES)), "dense DeepSeek-V3")


INTERLEAVED, HALF_SPLIT = tensors(True), tensors(False)

DEEPSEEK_V3 = Family(
    "deepseek_v3",
    ("deepseek_v3",),
    read,
    write,
    tensors=lambda hf: INTERLEAVED if hf.get("rope_interleave", True) else HALF_SPLIT,
    architectures={"deepseek_v3": ARCHITECTURE},
    gqa=None,  # MLA: its cache is the latent; fewer KV heads do not apply
    mla=lambda cfg: MLASupport("exact", "already MLA"),
    check_load=check_load,
    covers="dense DeepSeek-V3 checkpoints (what convert --to mla writes); DeepSeek-V3/R1 MoE for the cost model",
    example=dict(
        model_type="deepseek_v3",
        vocab_size=320,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        max_position_embeddings=64,
        first_k_dense_replace=2,
        **{k: v for k, v in DENSE_FIELDS.items() if k not in ("num_nextn_predict_layers", "num_mtp_layers")},
    ),
)
# The cost model's only
DEEPSEEK_V2 = Family(
    "deepseek_v2",
    ("deepseek_v2",),
    read,
    gqa=None,
    covers="DeepSeek-V2, DeepSeek-V2-Lite (MoE)",
    example=dict(
        model_type="deepseek_v2",
        vocab_size=320,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        moe_intermediate_size=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        max_position_embeddings=64,
    ),
)
