"""Model presets by exact name, written as the fields of each model's public ``config.json``.

Only the fields the cost model reads are kept; values are those of the Hugging Face Hub repositories named
beside each entry. Published sizes to check against are in ``PUBLISHED_PARAMS`` (total, active) with their
sources; tests compare ``model_param_count`` against them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import ModelConfig
from ..hf_config import from_hf_config

_LLAMA2 = dict(model_type="llama", vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5)
_LLAMA3 = dict(model_type="llama", vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5)
_LLAMA31_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
_DEEPSEEK_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)

HF_CONFIGS: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-2-7b-hf
    "llama-2-7b": dict(
        _LLAMA2, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=11008,
    ),
    # meta-llama/Llama-2-13b-hf
    "llama-2-13b": dict(
        _LLAMA2, hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
        intermediate_size=13824,
    ),
    # meta-llama/Llama-2-70b-hf
    "llama-2-70b": dict(
        _LLAMA2, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        intermediate_size=28672,
    ),
    # meta-llama/Meta-Llama-3-8B
    "llama-3-8b": dict(
        _LLAMA3, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, max_position_embeddings=8192,
    ),
    # meta-llama/Meta-Llama-3-70B
    "llama-3-70b": dict(
        _LLAMA3, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        intermediate_size=28672, max_position_embeddings=8192,
    ),
    # meta-llama/Llama-3.1-405B
    "llama-3.1-405b": dict(
        _LLAMA3, hidden_size=16384, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
        intermediate_size=53248, max_position_embeddings=131072, rope_scaling=_LLAMA31_ROPE,
    ),
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": dict(
        _LLAMA3, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling=dict(_LLAMA31_ROPE, factor=32.0),
    ),
    # mistralai/Mistral-7B-v0.1
    "mistral-7b": dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=32768, rms_norm_eps=1e-5,
        sliding_window=4096,
    ),
    # Qwen/Qwen2-7B
    "qwen2-7b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, intermediate_size=18944, max_position_embeddings=131072, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    # Qwen/Qwen2.5-72B
    "qwen2.5-72b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, intermediate_size=29568, max_position_embeddings=131072, rope_theta=1000000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    # Qwen/Qwen3-8B
    "qwen3-8b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=12288, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    # google/gemma-7b
    "gemma-7b": dict(
        model_type="gemma", vocab_size=256000, hidden_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=16, head_dim=256, intermediate_size=24576, max_position_embeddings=8192,
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
    ),
    # google/gemma-2-9b
    "gemma-2-9b": dict(
        model_type="gemma2", vocab_size=256000, hidden_size=3584, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, intermediate_size=14336, max_position_embeddings=8192,
        sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
    ),
    # google/gemma-3-1b-pt
    "gemma-3-1b": dict(
        model_type="gemma3_text", vocab_size=262144, hidden_size=1152, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, intermediate_size=6912, max_position_embeddings=32768,
        sliding_window=512, sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        query_pre_attn_scalar=256,
    ),
    # microsoft/Phi-3-mini-4k-instruct
    "phi-3-mini-4k": dict(
        model_type="phi3", vocab_size=32064, hidden_size=3072, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, intermediate_size=8192, max_position_embeddings=4096,
        original_max_position_embeddings=4096, sliding_window=2047, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    # allenai/OLMo-2-1124-7B
    "olmo-2-7b": dict(
        model_type="olmo2", vocab_size=100352, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, intermediate_size=11008, max_position_embeddings=4096, rope_theta=500000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    # EleutherAI/pythia-1b
    "pythia-1b": dict(
        model_type="gpt_neox", vocab_size=50304, hidden_size=2048, num_hidden_layers=16, num_attention_heads=8,
        intermediate_size=8192, max_position_embeddings=2048, rotary_pct=0.25, rotary_emb_base=10000,
        use_parallel_residual=True, tie_word_embeddings=False, layer_norm_eps=1e-5,
    ),
    # THUDM/glm-4-9b-hf
    "glm-4-9b": dict(
        model_type="glm", vocab_size=151552, hidden_size=4096, num_hidden_layers=40, num_attention_heads=32,
        num_key_value_heads=2, head_dim=128, intermediate_size=13696, max_position_embeddings=8192,
        partial_rotary_factor=0.5, attention_bias=True, rms_norm_eps=1.5625e-07, tie_word_embeddings=False,
    ),
    # THUDM/chatglm2-6b
    "chatglm2-6b": dict(
        model_type="chatglm", padded_vocab_size=65024, hidden_size=4096, num_layers=28, num_attention_heads=32,
        multi_query_attention=True, multi_query_group_num=2, kv_channels=128, ffn_hidden_size=13696,
        add_qkv_bias=True, add_bias_linear=False, seq_length=32768, layernorm_epsilon=1e-5, rmsnorm=True,
    ),
    # deepseek-ai/deepseek-llm-67b-base (a Llama architecture)
    "deepseek-67b": dict(
        model_type="llama", vocab_size=102400, hidden_size=8192, num_hidden_layers=95, num_attention_heads=64,
        num_key_value_heads=8, intermediate_size=22016, max_position_embeddings=4096, rms_norm_eps=1e-6,
    ),
    # deepseek-ai/DeepSeek-V2
    "deepseek-v2": dict(
        _DEEPSEEK_MLA, model_type="deepseek_v2", vocab_size=102400, hidden_size=5120, num_hidden_layers=60,
        num_attention_heads=128, q_lora_rank=1536, intermediate_size=12288, moe_intermediate_size=1536,
        n_routed_experts=160, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        moe_layer_freq=1, max_position_embeddings=163840,
    ),
    # deepseek-ai/DeepSeek-V2-Lite
    "deepseek-v2-lite": dict(
        _DEEPSEEK_MLA, model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, num_hidden_layers=27,
        num_attention_heads=16, q_lora_rank=None, intermediate_size=10944, moe_intermediate_size=1408,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        moe_layer_freq=1, max_position_embeddings=163840,
    ),
    # deepseek-ai/DeepSeek-V3 (without the multi-token-prediction module, as the 671B figure)
    "deepseek-v3": dict(
        _DEEPSEEK_MLA, model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, num_hidden_layers=61,
        num_attention_heads=128, q_lora_rank=1536, intermediate_size=18432, moe_intermediate_size=2048,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
        moe_layer_freq=1, max_position_embeddings=163840,
    ),
    # HuggingFaceTB/SmolLM-135M (the shape of the benchmarks' 135M-parameter model)
    "smollm-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True,
        rope_theta=10000.0, rms_norm_eps=1e-5,
    ),
    # openai-community/gpt2
    "gpt2": dict(
        model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
        layer_norm_epsilon=1e-5,
    ),
    # google-bert/bert-base-uncased
    "bert-base-uncased": dict(
        model_type="bert", vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
        intermediate_size=3072, max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
    ),
}  # fmt: skip

# (total, active) parameters as published, and where. Rounded figures are checked with a tolerance.
PUBLISHED_PARAMS: dict[str, tuple[float, float | None, str]] = {
    "llama-2-7b": (6.74e9, None, "Llama 2 model card: 6.74B (HF safetensors metadata: 6,738,415,616)"),
    "llama-2-13b": (13.0e9, None, "Llama 2 paper (arXiv 2307.09288), Table 1: 13B"),
    "llama-2-70b": (68.98e9, None, "HF safetensors metadata of Llama-2-70b-hf: 68,976,648,192"),
    "llama-3-8b": (8.03e9, None, "HF safetensors metadata of Meta-Llama-3-8B: 8,030,261,248"),
    "llama-3-70b": (70.6e9, None, "HF safetensors metadata of Meta-Llama-3-70B: 70,553,706,496"),
    "llama-3.1-405b": (405e9, None, "Llama 3 paper (arXiv 2407.21783): 405B"),
    "mistral-7b": (7.24e9, None, "HF safetensors metadata of Mistral-7B-v0.1: 7,241,732,096"),
    "qwen2-7b": (7.62e9, None, "Qwen2 technical report (arXiv 2407.10671), Table 1: 7.6B incl. embeddings"),
    "qwen2.5-72b": (72.7e9, None, "Qwen2.5 model card: 72.7B"),
    "llama-3.2-1b": (1.23e9, None, "Llama 3.2 model card: 1.23B"),
    "qwen3-8b": (8.2e9, None, "Qwen3-8B model card: 8.2B"),
    "gemma-7b": (8.54e9, None, "HF safetensors metadata of gemma-7b: 8.54B"),
    "gemma-2-9b": (
        9.24e9,
        None,
        "Gemma 2 report (arXiv 2408.00118), Table 2: 8,324,201,984 non-embedding + 917,504,000 embedding",
    ),
    "gemma-3-1b": (
        1.0e9,
        None,
        "Gemma 3 report (arXiv 2503.19786), Table 1: 302M embedding + 698M non-embedding",
    ),
    "phi-3-mini-4k": (3.8e9, None, "Phi-3 report (arXiv 2404.14219): 3.8B"),
    "olmo-2-7b": (7.3e9, None, "OLMo 2 model card: 7.3B (HF safetensors metadata: 7.30B)"),
    "pythia-1b": (1_011_781_632, None, "Pythia paper (arXiv 2304.01373), Table 1: 1,011,781,632 total"),
    "glm-4-9b": (9.4e9, None, "GLM-4-9B model card: 9.4B"),
    "chatglm2-6b": (6.24e9, None, "HF safetensors metadata of chatglm2-6b: 6.24B"),
    "deepseek-67b": (67e9, None, "DeepSeek LLM paper (arXiv 2401.02954): 67B"),
    "deepseek-v2": (236e9, 21e9, "DeepSeek-V2 paper (arXiv 2405.04434): 236B total, 21B activated"),
    "deepseek-v2-lite": (15.7e9, 2.4e9, "DeepSeek-V2 paper, Appendix B: 15.7B total, 2.4B activated"),
    "deepseek-v3": (671e9, 37e9, "DeepSeek-V3 report (arXiv 2412.19437): 671B total, 37B activated"),
    "smollm-135m": (134_515_008, None, "HF safetensors metadata of SmolLM-135M: 134,515,008"),
    "gpt2": (124.44e6, None, "HF safetensors metadata of gpt2: 124,439,808"),
    "bert-base-uncased": (109.48e6, None, "HF safetensors metadata of bert-base-uncased: 109,482,240"),
}


def preset_names() -> list[str]:
    return list(HF_CONFIGS)


def get_preset(name: str) -> ModelConfig:
    """The preset of exactly this name (no prefix or substring matching)."""
    if name not in HF_CONFIGS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(HF_CONFIGS)}")
    return from_hf_config(HF_CONFIGS[name], name=name)


def load_model(spec: str | Path) -> ModelConfig:
    """A preset name, or a path to a ``config.json`` (or to the directory holding one)."""
    if not isinstance(spec, (str, Path)) or not str(spec).strip():
        raise (ValueError if isinstance(spec, str) else TypeError)(
            f"model must be a preset name or a config.json path, got {spec!r}"
        )
    if isinstance(spec, str) and spec in HF_CONFIGS:
        return get_preset(spec)
    path = Path(spec)
    if path.suffix == ".json" or path.is_dir() or path.exists():
        return from_hf_config(path)
    raise ValueError(
        f"unknown model preset {str(spec)!r} (and no such config.json); presets: {', '.join(HF_CONFIGS)}"
    )
