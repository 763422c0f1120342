"""Parameter counts, from the configs alone.

Each count is the number of elements of the weights a module builds: ``param_count(cfg)`` equals
``sum(p.numel() for p in GroupedQueryAttention(cfg).parameters())`` (or the MLA module's), and
``model_param_count(cfg)`` equals the same sum over ``attnlab.model.Transformer(cfg)`` for the dense SwiGLU models
it builds; the MoE, GELU/LayerNorm, position-embedding and pooler terms follow the Hugging Face modules of
DeepSeek-V2/V3, GPT-2 and BERT.
"""

from __future__ import annotations

from ..config import GATED_MLPS, AttentionConfig, MLAConfig, ModelConfig


def _check_attention(cfg: object) -> None:
    if not isinstance(cfg, (AttentionConfig, MLAConfig)):
        raise TypeError(f"cfg must be an AttentionConfig or MLAConfig, got {type(cfg).__name__}")


def param_count(cfg: AttentionConfig | MLAConfig) -> int:
    """Weights of one attention layer (projections, their biases, MLA's norms)."""
    _check_attention(cfg)
    d, h = cfg.d_model, cfg.n_heads
    if isinstance(cfg, AttentionConfig):
        hd, kvh = cfg.head_dim, cfg.n_kv_heads
        # wq: d -> h*hd, wk and wv: d -> kvh*hd, wo: h*hd -> d
        n = d * h * hd + 2 * d * kvh * hd + h * hd * d
        if cfg.bias:
            n += h * hd + 2 * kvh * hd
        if cfg.has_out_bias:
            n += d
        if cfg.qk_norm == "head":  # one gain per head dim for q and one for k, shared by the heads
            n += 2 * hd
        elif cfg.qk_norm == "full":  # one gain per value of all heads
            n += (h + kvh) * hd
        return n
    n = 0
    if cfg.q_lora_rank:
        # wq_a: d -> q_lora_rank (bias as DeepSeek's attention_bias), q_norm gain, wq_b: q_lora_rank -> h*qk
        n += d * cfg.q_lora_rank + (cfg.q_lora_rank if cfg.bias else 0)
        n += cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
    else:
        n += d * h * cfg.qk_head_dim
    n += d * cfg.cache_dim + (cfg.cache_dim if cfg.bias else 0)  # wkv_a: latent and shared rotary key
    if getattr(cfg, "kv_norm", True):
        n += cfg.kv_lora_rank
    n += cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # wkv_b: W_uk and W_uv
    n += h * cfg.v_head_dim * d + (d if cfg.bias else 0)  # wo
    return n


def norm_param_count(model_cfg: ModelConfig) -> int:
    """One normalisation layer: RMSNorm has a gain, LayerNorm a gain and a bias."""
    return model_cfg.d_model * (2 if model_cfg.norm == "layernorm" else 1)


def mlp_param_count(d_model: int, ffn_dim: int, kind: str, bias: bool) -> int:
    """Gated (SwiGLU, GeGLU): gate and up (d -> f), down (f -> d). Plain (GELU): up and down."""
    if kind in GATED_MLPS:
        return 3 * d_model * ffn_dim + ((2 * ffn_dim + d_model) if bias else 0)
    return 2 * d_model * ffn_dim + ((ffn_dim + d_model) if bias else 0)


def norms_per_layer(model_cfg: ModelConfig) -> int:
    """Norms in one decoder layer: one per sublayer (before it, or after it), two with sandwich norms."""
    return 4 if model_cfg.norm_placement == "sandwich" else 2


def moe_layer_param_count(model_cfg: ModelConfig, *, active: bool = False) -> int:
    """A DeepSeekMoE layer: a router (n_experts x d_model), routed experts, shared experts.

    With ``active`` only the experts one token runs through: the ``n_active_experts`` it is routed to and the
    shared ones (DeepSeek-V2, arXiv 2405.04434, Sec. 2.2).
    """
    d = model_cfg.d_model
    expert = mlp_param_count(d, model_cfg.moe_ffn_dim, model_cfg.mlp, model_cfg.mlp_bias)
    routed = model_cfg.n_active_experts if active else model_cfg.n_experts
    return d * model_cfg.n_experts + (routed + model_cfg.n_shared_experts) * expert


def embedding_param_count(model_cfg: ModelConfig) -> int:
    """Token, learned position and token-type embeddings."""
    return (model_cfg.vocab_size + model_cfg.n_positions + model_cfg.n_token_types) * model_cfg.d_model


def model_param_count(model_cfg: ModelConfig, *, active: bool = False) -> int:
    """Weights of a whole model; ``active=True`` counts only what one token computes with.

    Active parameters leave out the routed experts a token is not sent to and the embedding tables, from
    which a token only gathers a row (a tied table still counts, as the LM head). This is the convention of
    DeepSeek's "activated" figures: V2 21B, V2-Lite 2.4B, V3 37B are reproduced within 2.5%.

    Layout: embeddings, per layer (attention, 2 norms, MLP or MoE), one more norm (the final norm of a
    pre-norm decoder; for BERT the embedding LayerNorm, so the count is the same), the LM head unless tied
    to the embeddings, and BERT's pooler.
    """
    if not isinstance(model_cfg, ModelConfig):
        raise TypeError(f"model_cfg must be a ModelConfig, got {type(model_cfg).__name__}")
    d = model_cfg.d_model
    n_moe = model_cfg.n_layers - model_cfg.n_dense_layers if model_cfg.is_moe else 0
    n_dense = model_cfg.n_layers - n_moe
    dense_mlp = mlp_param_count(d, model_cfg.ffn_dim, model_cfg.mlp, model_cfg.mlp_bias)
    n = 0 if active else embedding_param_count(model_cfg)
    if active and model_cfg.tie_embeddings:
        n += model_cfg.vocab_size * d
    n += sum(param_count(attn) for attn in model_cfg.layer_attentions)
    n += model_cfg.n_layers * norms_per_layer(model_cfg) * norm_param_count(model_cfg)
    n += n_dense * dense_mlp
    if n_moe:
        n += n_moe * moe_layer_param_count(model_cfg, active=active)
    n += norm_param_count(model_cfg)
    if not model_cfg.tie_embeddings:
        n += model_cfg.vocab_size * d
    if model_cfg.pooler:
        n += d * d + d
    return n
