"""ChatGLM2/3 (THUDM's ``modeling_chatglm.py``): read for the cost model: ``multi_query_group_num`` KV heads of width
``kv_channels``, RMSNorm, SwiGLU, rotary on the first half of each head."""

from __future__ import annotations

from ..config import AttentionConfig, ModelConfig
from .base import Family, Fields, check_heads


def read(f: Fields) -> ModelConfig:
    d, n_heads = f.int("hidden_size"), f.int("num_attention_heads")
    if not f.bool("rmsnorm", True):
        f.unsupported("rmsnorm", "a LayerNorm ChatGLM")
    n_kv = f.int("multi_query_group_num") if f.bool("multi_query_attention", False) else n_heads
    head_dim = f.opt_int("kv_channels")  # absent: hidden_size / num_attention_heads, which must divide
    check_heads(f, d, n_heads, n_kv, head_dim, "multi_query_group_num", "kv_channels")
    head_dim = head_dim or d // n_heads
    attention = AttentionConfig(
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        bias=f.bool("add_qkv_bias", False),
        out_bias=f.bool("add_bias_linear", False),
        rope_dim=head_dim // 2,
        rope_interleaved=True,
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


CHATGLM = Family("chatglm", ("chatglm",), read)
