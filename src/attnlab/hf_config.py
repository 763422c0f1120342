"""Hugging Face ``config.json`` <-> ``ModelConfig``: the one reader (and writer) of those fields.

``from_hf_config`` reads Llama, Mistral, Qwen2, ChatGLM, DeepSeek-V2/V3, GPT-2 and BERT configs for the cost model
(``attnlab.cost``), the checkpoint loaders (``attnlab.hf``) and the benchmark's baselines (``attnlab.bench``). Each
reader takes the fields its model's modeling code uses and nothing else; a required field that is missing, of the
wrong type, or inconsistent with the others raises ``ValueError`` naming the field and value. ``to_hf_config``
and ``attention_to_hf`` write the fields back (the decoder's, and those of its attention), which the checkpoint
writers complete with each family's own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import AttentionConfig, MLAConfig, ModelConfig

_MISSING = object()
# No model has a size field past this (2**31: 8x the largest vocabulary or context in use); beyond it a value is
# a typo, and products of such values would overflow the floats of the roofline.
MAX_FIELD = 2**31


class _Fields:
    """Typed access to a config dict; every error names the field."""

    def __init__(self, raw: dict[str, Any], model_type: str) -> None:
        self.raw, self.model_type = raw, model_type

    def _get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key, default)
        if value is _MISSING:
            raise ValueError(f"{self.model_type} config.json: missing field {key!r}")
        return value

    def int(self, key: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{self.model_type} config.json: field {key!r} must be an int, got {value!r}")
        if not minimum <= value <= MAX_FIELD:
            raise ValueError(
                f"{self.model_type} config.json: field {key!r} must be in [{minimum}, {MAX_FIELD}], got {value}"
            )
        return value

    def opt_int(self, key: str, *, minimum: int = 1) -> int | None:
        return None if self.raw.get(key) is None else self.int(key, minimum=minimum)

    def float(self, key: str, default: Any = _MISSING) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{self.model_type} config.json: field {key!r} must be a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an int past the float range
            number = math.inf
        if not math.isfinite(number):
            raise ValueError(f"{self.model_type} config.json: field {key!r} must be finite, got {value!r}")
        return number

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ValueError(
                f"{self.model_type} config.json: field {key!r} must be true or false, got {value!r}"
            )
        return value

    def rope_theta(self) -> float:
        """RoPE base, where transformers finds it (``rope_parameters``)."""
        return _Fields(rope_parameters(self.raw, self.model_type), self.model_type).float("rope_theta")

    def fail(self, message: str) -> None:
        raise ValueError(f"{self.model_type} config.json: {message}")


def rope_parameters(
    raw: dict[str, Any], model_type: str = "", default_theta: float = 10000.0
) -> dict[str, Any]:
    """The RoPE parameters of a config.json, with transformers' precedence (``convert_rope_params_to_dict``,
    transformers 5): the older ``rope_scaling`` when it is set, else ``rope_parameters``; ``rope_theta`` from
    inside them, else from the top level, else the default; ``rope_type`` (or the older ``type``), else "default".
    A config that writes both fields differently is therefore read as transformers reads it, not by field order."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        name = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
        raise ValueError(
            f"{model_type or 'the'} config.json: field {name!r} must be an object, got {params!r}"
        )
    params = dict(params)
    params.setdefault("rope_theta", raw.get("rope_theta", default_theta))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _heads(
    f: _Fields,
    d_model: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int | None,
    kv_key: str,
    head_dim_key: str = "head_dim",
) -> None:
    if n_heads % n_kv_heads:
        f.fail(f"{kv_key}={n_kv_heads} does not divide num_attention_heads={n_heads}")
    if head_dim is None and d_model % n_heads:
        f.fail(
            f"hidden_size={d_model} is not divisible by num_attention_heads={n_heads} and {head_dim_key} is not given"
        )


def _llama_like(f: _Fields) -> ModelConfig:
    """Llama, Mistral, Qwen2 (and DeepSeek-67B, which is a Llama): ``num_key_value_heads``, optional ``head_dim``."""
    d, n_heads = f.int("hidden_size"), f.int("num_attention_heads")
    n_kv = f.int("num_key_value_heads", n_heads)
    head_dim = f.opt_int("head_dim")
    _heads(f, d, n_heads, n_kv, head_dim, "num_key_value_heads")
    if f.model_type == "qwen2":
        bias, out_bias = True, False  # Qwen2 puts biases on q/k/v only (modeling_qwen2.py)
    else:
        bias = f.bool("attention_bias", False)
        out_bias = None
    attention = AttentionConfig(
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        bias=bias,
        out_bias=out_bias,
        rope_theta=f.rope_theta(),
    )
    return ModelConfig(
        vocab_size=f.int("vocab_size"),
        n_layers=f.int("num_hidden_layers"),
        attention=attention,
        ffn_dim=f.int("intermediate_size"),
        max_seq_len=f.int("max_position_embeddings", 4096),
        norm_eps=f.float("rms_norm_eps", 1e-6),
        mlp_bias=f.bool("mlp_bias", False),
        tie_embeddings=f.bool("tie_word_embeddings", False),
    )


def _chatglm(f: _Fields) -> ModelConfig:
    """ChatGLM2/3: ``multi_query_group_num`` KV heads of width ``kv_channels`` (THUDM modeling_chatglm.py)."""
    d, n_heads = f.int("hidden_size"), f.int("num_attention_heads")
    if not f.bool("rmsnorm", True):
        f.fail("rmsnorm=false (LayerNorm ChatGLM) is not supported")
    n_kv = f.int("multi_query_group_num") if f.bool("multi_query_attention", False) else n_heads
    head_dim = f.opt_int("kv_channels")  # absent: hidden_size / num_attention_heads, which must divide
    _heads(f, d, n_heads, n_kv, head_dim, "multi_query_group_num", "kv_channels")
    head_dim = head_dim or d // n_heads
    attention = AttentionConfig(
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        bias=f.bool("add_qkv_bias", False),
        out_bias=f.bool("add_bias_linear", False),
    )
    return ModelConfig(
        vocab_size=f.int("padded_vocab_size"),
        n_layers=f.int("num_layers"),
        attention=attention,
        ffn_dim=f.int("ffn_hidden_size"),
        max_seq_len=f.int("seq_length", 2048),
        norm_eps=f.float("layernorm_epsilon", 1e-5),
        mlp_bias=f.bool("add_bias_linear", False),
        tie_embeddings=False,
    )


def _deepseek(f: _Fields) -> ModelConfig:
    """DeepSeek-V2/V3: MLA (``kv_lora_rank``, ``q_lora_rank``, rope/nope/v head dims) and DeepSeekMoE."""
    d = f.int("hidden_size")
    attention = MLAConfig(
        d_model=d,
        n_heads=f.int("num_attention_heads"),
        kv_lora_rank=f.int("kv_lora_rank"),
        qk_nope_head_dim=f.int("qk_nope_head_dim", minimum=0),
        qk_rope_head_dim=f.int("qk_rope_head_dim"),
        v_head_dim=f.int("v_head_dim"),
        q_lora_rank=f.opt_int("q_lora_rank") or 0,  # null: queries are not compressed (V2-Lite)
        rope_theta=f.rope_theta(),
        bias=f.bool("attention_bias", False),
    )
    n_layers = f.int("num_hidden_layers")
    moe: dict[str, int] = {}
    # No routed experts, or first_k_dense_replace covering every layer (attnlab.hf.deepseek writes both): dense.
    n_experts = f.opt_int("n_routed_experts", minimum=0)
    if n_experts and f.int("first_k_dense_replace", 0, minimum=0) != n_layers:
        if f.int("moe_layer_freq", 1) != 1:
            f.fail(
                f"moe_layer_freq={f.raw['moe_layer_freq']} is not supported (only 1: every layer after the dense ones)"
            )
        first_dense = f.int("first_k_dense_replace", 0, minimum=0)
        if first_dense > n_layers:
            f.fail(f"first_k_dense_replace={first_dense} exceeds num_hidden_layers={n_layers}")
        n_active = f.int("num_experts_per_tok")
        if n_active > n_experts:
            f.fail(f"num_experts_per_tok={n_active} exceeds n_routed_experts={n_experts}")
        moe = dict(
            n_experts=n_experts,
            n_shared_experts=f.int("n_shared_experts", 0, minimum=0),
            n_active_experts=n_active,
            moe_ffn_dim=f.int("moe_intermediate_size"),
            n_dense_layers=first_dense,
        )
    return ModelConfig(
        vocab_size=f.int("vocab_size"),
        n_layers=n_layers,
        attention=attention,
        ffn_dim=f.int("intermediate_size"),
        max_seq_len=f.int("max_position_embeddings", 4096),
        norm_eps=f.float("rms_norm_eps", 1e-6),
        tie_embeddings=f.bool("tie_word_embeddings", False),
        **moe,
    )


def _gpt2(f: _Fields) -> ModelConfig:
    """GPT-2: learned positions, LayerNorm, GELU MLP, biases everywhere, LM head tied to the token table."""
    d, n_heads = f.int("n_embd"), f.int("n_head")
    _heads(f, d, n_heads, n_heads, None, "n_head")
    n_positions = f.int("n_positions")
    inner = f.opt_int("n_inner")
    return ModelConfig(
        vocab_size=f.int("vocab_size"),
        n_layers=f.int("n_layer"),
        attention=AttentionConfig(d_model=d, n_heads=n_heads, bias=True, rope=False),
        ffn_dim=inner or 4 * d,
        max_seq_len=n_positions,
        norm_eps=f.float("layer_norm_epsilon", 1e-5),
        mlp="gelu",
        mlp_bias=True,
        tie_embeddings=f.bool("tie_word_embeddings", True),
        norm="layernorm",
        n_positions=n_positions,
    )


def _bert(f: _Fields) -> ModelConfig:
    """BERT encoder (BertModel with its pooler; no MLM head, hence ``tie_embeddings``)."""
    d, n_heads = f.int("hidden_size"), f.int("num_attention_heads")
    _heads(f, d, n_heads, n_heads, None, "num_attention_heads")
    if f.raw.get("position_embedding_type", "absolute") != "absolute":
        f.fail(
            f"position_embedding_type={f.raw['position_embedding_type']!r} is not supported (only 'absolute')"
        )
    n_positions = f.int("max_position_embeddings")
    return ModelConfig(
        vocab_size=f.int("vocab_size"),
        n_layers=f.int("num_hidden_layers"),
        attention=AttentionConfig(d_model=d, n_heads=n_heads, bias=True, rope=False),
        ffn_dim=f.int("intermediate_size"),
        max_seq_len=n_positions,
        norm_eps=f.float("layer_norm_eps", 1e-12),
        mlp="gelu",
        mlp_bias=True,
        tie_embeddings=True,
        norm="layernorm",
        n_positions=n_positions,
        n_token_types=f.int("type_vocab_size", 2),
        pooler=True,
    )


READERS: dict[str, Callable[[_Fields], ModelConfig]] = {
    "llama": _llama_like,
    "mistral": _llama_like,
    "qwen2": _llama_like,
    "chatglm": _chatglm,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "gpt2": _gpt2,
    "bert": _bert,
}


def from_hf_config(path_or_dict: str | Path | dict[str, Any], *, name: str | None = None) -> ModelConfig:
    """Read a ``config.json`` (a path to it, to its directory, or the parsed dict) into a ``ModelConfig``."""
    if isinstance(path_or_dict, dict):
        raw, default_name = path_or_dict, ""
    elif isinstance(path_or_dict, (str, Path)):
        path = Path(path_or_dict)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        default_name = path.parent.name
    else:
        raise TypeError(f"path_or_dict must be a path or a dict, got {type(path_or_dict).__name__}")
    model_type = raw.get("model_type")
    if model_type not in READERS:
        raise ValueError(
            f"config.json: model_type={model_type!r} is not supported; supported: {', '.join(READERS)}"
        )
    cfg = READERS[model_type](_Fields(raw, model_type))
    return cfg.replace(name=name if name is not None else (raw.get("_name_or_path") or default_name))


def attention_to_hf(attn: AttentionConfig | MLAConfig) -> dict[str, Any]:
    """The config.json fields of ``attn`` (Llama family, or DeepSeek-V3 for MLA); the inverse of the readers.

    Biases are left to each family: Llama and DeepSeek write ``attention_bias``, Mistral has none, Qwen2 fixes them.
    """
    if not isinstance(attn, (AttentionConfig, MLAConfig)):
        raise TypeError(f"attn must be an AttentionConfig or MLAConfig, got {type(attn).__name__}")
    common: dict[str, Any] = dict(
        hidden_size=attn.d_model,
        num_attention_heads=attn.n_heads,
        rope_parameters={"rope_type": "default", "rope_theta": attn.rope_theta},
    )
    if isinstance(attn, AttentionConfig):
        return common | dict(num_key_value_heads=attn.n_kv_heads, head_dim=attn.head_dim)
    return common | dict(
        num_key_value_heads=attn.n_heads,  # transformers repeats MLA's per-head keys by this ratio: 1
        q_lora_rank=attn.q_lora_rank or None,
        kv_lora_rank=attn.kv_lora_rank,
        qk_nope_head_dim=attn.qk_nope_head_dim,
        qk_rope_head_dim=attn.qk_rope_head_dim,
        v_head_dim=attn.v_head_dim,
        attention_bias=attn.bias,
    )


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields of a decoder (``attnlab.model.Transformer``: RMSNorm, SwiGLU, RoPE) and its attention."""
    return attention_to_hf(cfg.attention) | dict(
        num_hidden_layers=cfg.n_layers,
        intermediate_size=cfg.ffn_dim,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        hidden_act="silu",
        tie_word_embeddings=cfg.tie_embeddings,
    )
