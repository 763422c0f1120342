"""A BERT encoder built on ``GroupedQueryAttention``, loaded from and exported to Hugging Face BERT checkpoints.

Hugging Face's ``BertModel`` has no GQA, so a converted encoder lives in attnlab (``BertEncoder`` with any
``n_kv_heads``) and is exported in the MHA layout: each KV head's key/value rows are repeated for the query heads
of its group (``export_bert_mha``). That checkpoint loads in any BERT implementation and computes exactly the GQA
model, at MHA cost; the saving is realised by loading it back into attnlab (``load_bert(..., n_kv_heads=G)``
takes one head per group).

Shapes: input_ids (B, T) int64, attention_mask (B, T) with 1 = token, 0 = padding; hidden states (B, T, d_model).
Post-norm blocks as in BERT: ``h = LN(x + attention(x))``, ``out = LN(h + W_out gelu(W_in h))``; erf GELU.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.gqa import GroupedQueryAttention
from ..config import AttentionConfig, ModelConfig
from ..families.bert import TENSORS
from ..hf_config import from_hf_config
from . import io
from .causal_lm import collapse_repeated_kv_heads, repeat_kv_heads


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int
    n_layers: int
    attention: AttentionConfig  # rope=False, bias=True for BERT
    ffn_dim: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    norm_eps: float = 1e-12

    def with_attention(self, attention: AttentionConfig) -> EncoderConfig:
        return dataclasses.replace(self, attention=attention)

    def replace(self, **changes) -> EncoderConfig:
        return dataclasses.replace(self, **changes)

    @property
    def max_seq_len(self) -> int:
        """The longest input, by the decoder's name (calibration text is cut to it)."""
        return self.max_position_embeddings


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        d = cfg.attention.d_model
        self.attention = GroupedQueryAttention(cfg.attention)
        self.attention_norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.ffn_in = nn.Linear(d, cfg.ffn_dim)
        self.ffn_out = nn.Linear(cfg.ffn_dim, d)
        self.ffn_norm = nn.LayerNorm(d, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.attention_norm(x + self.attention(x, attn_mask=attn_mask, is_causal=False))
        return self.ffn_norm(h + self.ffn_out(F.gelu(self.ffn_in(h))))


class BertEncoder(nn.Module):
    takes_padding_mask = True  # forward(input_ids, attention_mask): how attnlab.convert calibrates it

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        if cfg.attention.rope or cfg.attention.n_heads * cfg.attention.head_dim != cfg.attention.d_model:
            raise ValueError("BertEncoder needs rope=False and n_heads * head_dim == d_model")
        self.cfg = cfg
        d = cfg.attention.d_model
        self.word_embeddings = nn.Embedding(cfg.vocab_size, d)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, d)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, d)
        self.embeddings_norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
        t = input_ids.shape[1]
        if t > self.cfg.max_position_embeddings:
            raise ValueError(
                f"sequence of {t} tokens exceeds max_position_embeddings={self.cfg.max_position_embeddings}"
            )
        positions = torch.arange(t, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = self.embeddings_norm(x + self.token_type_embeddings(torch.zeros_like(input_ids)))
        mask = (
            None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        )  # (B, 1, 1, T) keys
        for layer in self.layers:
            x = layer(x, mask)
        return x


def sentence_embeddings(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """sentence-transformers pooling: mean of the token states over the mask, then L2-normalised. (B, d)."""
    hidden = model(input_ids, attention_mask)
    m = attention_mask[..., None].to(hidden.dtype)
    pooled = (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)
    return F.normalize(pooled, dim=-1)


def encoder_config_from_hf(hf: dict, n_kv_heads: int | None = None) -> EncoderConfig:
    """The encoder of a BERT config.json (a dict), read by ``attnlab.hf_config`` as the cost model reads it;
    ``n_kv_heads`` overrides the checkpoint's (an MHA-layout export of a GQA encoder)."""
    if hf.get("model_type") != "bert":
        raise ValueError(f"expected model_type 'bert', got {hf.get('model_type')!r}")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"config.json hidden_act={hf['hidden_act']!r}: only BERT with 'gelu' is supported")
    cfg = from_hf_config(hf)  # also refuses position embeddings other than absolute
    attention = cfg.attention if n_kv_heads is None else cfg.attention.replace(n_kv_heads=n_kv_heads)
    return EncoderConfig(
        vocab_size=cfg.vocab_size,
        n_layers=cfg.n_layers,
        attention=attention,
        ffn_dim=cfg.ffn_dim,
        max_position_embeddings=cfg.n_positions,
        type_vocab_size=cfg.n_token_types,
        norm_eps=cfg.norm_eps,
    )


def _take_one_head_per_group(w: torch.Tensor, cfg: AttentionConfig) -> torch.Tensor:
    """Inverse of the MHA export: KV rows (n_heads * head_dim, ...) -> (n_kv_heads * head_dim, ...)."""
    heads = w.reshape(cfg.n_heads, cfg.head_dim, *w.shape[1:])
    groups = heads.reshape(cfg.n_kv_heads, cfg.n_rep, *heads.shape[1:])
    if not torch.equal(groups, groups[:, :1].expand_as(groups)):
        raise ValueError(f"the key/value heads are not repeated in groups of {cfg.n_rep}; cannot load as GQA")
    return groups[:, 0].reshape(-1, *w.shape[1:])


def load_bert(src: str | Path, n_kv_heads: int | None = None) -> tuple[BertEncoder, dict[str, torch.Tensor]]:
    """The encoder of a BERT checkpoint and the tensors it does not use (pooler), to carry through an export.

    ``n_kv_heads``: load an MHA-layout export of a GQA encoder back as GQA (its K/V heads must be repeated);
    by default, the fewest KV heads whose repetition the checkpoint is, bit for bit (``collapse_repeated_kv_heads``,
    as causal LMs are read): an export of ``attnlab convert`` is read as the GQA encoder it computes.
    """
    hf = io.read_config(src)
    cfg = encoder_config_from_hf(hf, n_kv_heads)
    tensors, _ = io.read_tensors(src)
    state = TENSORS.to_attnlab(tensors, from_hf_config(hf))  # names by the family's tensor map
    extra = {TENSORS.bare(k): v for k, v in tensors.items() if TENSORS.bare(k).startswith("pooler.")}
    if n_kv_heads is None:
        cfg, state = collapse_repeated_kv_heads(cfg, state)
    elif cfg.attention.n_kv_heads != cfg.attention.n_heads:
        for name in [n for n in state if re.search(r"attention\.w[kv]\.", n)]:
            state[name] = _take_one_head_per_group(state[name], cfg.attention)
    model = io.assign(src, lambda: BertEncoder(cfg), state, TENSORS.theirs)
    io.check_finite(model, src, TENSORS.theirs)
    return model.eval(), extra


def mha_tensors(model: BertEncoder) -> dict[str, torch.Tensor]:
    """BertModel tensors of ``model`` with every KV head repeated for its group (MHA layout)."""
    cfg = model.cfg
    mha = ModelConfig(
        vocab_size=cfg.vocab_size,
        n_layers=cfg.n_layers,
        attention=cfg.attention.replace(n_kv_heads=cfg.attention.n_heads),
        ffn_dim=cfg.ffn_dim,
    )
    return TENSORS.to_checkpoint(repeat_kv_heads(model.state_dict(), cfg.attention), mha)


def bert_config(model: BertEncoder, base: dict | None = None) -> dict:
    cfg = model.cfg
    hf = dict(base or {})
    hf.update(
        model_type="bert",
        architectures=hf.get("architectures", ["BertModel"]),
        hidden_size=cfg.attention.d_model,
        num_attention_heads=cfg.attention.n_heads,
        num_hidden_layers=cfg.n_layers,
        intermediate_size=cfg.ffn_dim,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        type_vocab_size=cfg.type_vocab_size,
        layer_norm_eps=cfg.norm_eps,
        hidden_act="gelu",
    )
    return hf


def export_bert_mha(
    model: BertEncoder,
    dst: str | Path,
    *,
    base_config: dict | None = None,
    extra: dict[str, torch.Tensor] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as a BertModel checkpoint in the MHA layout (atomically); ``extra``: e.g. the pooler."""
    return io.write_checkpoint(
        dst, mha_tensors(model) | dict(extra or {}), bert_config(model, base_config), overwrite
    )
