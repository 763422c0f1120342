"""Llama, Mistral and Qwen2 checkpoints (Hugging Face layout) <-> ``attnlab.model.Transformer``.

The conversion is a key map plus one named transform. Keys (N = layer index):

    model.embed_tokens.weight                  tok_embeddings.weight
    model.layers.N.self_attn.{q,k,v,o}_proj    layers.N.attention.{wq,wk,wv,wo}      (.weight, .bias)
    model.layers.N.input_layernorm             layers.N.attention_norm
    model.layers.N.mlp.{gate,down,up}_proj     layers.N.feed_forward.{w1,w2,w3}
    model.layers.N.post_attention_layernorm    layers.N.ffn_norm
    model.norm / lm_head                       norm / output   (lm_head absent when embeddings are tied)

RoPE layout: Hugging Face Llama rotates the pairs (i, i + head_dim/2) of each head, as attnlab does, so the
weights map unchanged. Meta's original checkpoints pair (2i, 2i + 1) instead; ``layout="interleaved"`` permutes
the rows of each ``wq``/``wk`` head with ``interleaved_to_half_split`` on import and back on export.

Biases: Llama/Mistral put ``attention_bias`` on q, k, v and o; Qwen2 has q/k/v biases and none on o
(``AttentionConfig(bias=True, out_bias=False)``). Mistral's sliding window is not modelled: attnlab attends
to the whole context, which equals Mistral for sequences up to ``sliding_window`` tokens.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..attention.rope import interleaved_to_half_split
from ..config import AttentionConfig, ModelConfig
from ..hf_config import from_hf_config, rope_parameters, to_hf_config
from ..model import Transformer
from . import io

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
LAYOUTS = ("half_split", "interleaved")
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # a buffer older checkpoints saved; recomputed
_LAYER_MAP = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3",
}
_TOP_MAP = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "output"}


def check_default_rope(hf: dict) -> None:
    """Only plain RoPE converts exactly; scaled variants (yarn, llama3, dynamic, ...) are refused."""
    kind = rope_parameters(hf, hf.get("model_type", ""))["rope_type"]
    if kind != "default":
        raise ValueError(f"config.json rope_type={kind!r} is not supported (only 'default' RoPE)")


def model_config_from_hf(hf: dict) -> ModelConfig:
    """The ``ModelConfig`` of a Llama / Mistral / Qwen2 config.json (a dict), read by ``attnlab.hf_config``
    after the checks that an exact weight conversion needs."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join([*ARCHITECTURES, 'bert'])}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"config.json hidden_act={hf.get('hidden_act')!r}: only 'silu' (SwiGLU) is supported"
        )
    check_default_rope(hf)
    return from_hf_config(hf)


def hf_config_from_model(cfg: ModelConfig, model_type: str = "llama", base: dict | None = None) -> dict:
    """A config.json dict for ``cfg``: ``base`` (e.g. the source's) with the architecture fields set."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type must be one of {', '.join(ARCHITECTURES)}; got {model_type!r}")
    attn = cfg.attention
    if not isinstance(attn, AttentionConfig):
        raise ValueError("only GQA/MHA/MQA attention can be exported to Llama-family checkpoints")
    if model_type == "qwen2" and not (attn.bias and not attn.has_out_bias):
        raise ValueError("qwen2 needs AttentionConfig(bias=True, out_bias=False)")
    if model_type == "mistral" and (attn.bias or attn.has_out_bias):
        raise ValueError("mistral has no attention biases; AttentionConfig.bias must be False")
    if model_type != "qwen2" and attn.has_out_bias != attn.bias:
        raise ValueError(f"{model_type} puts attention_bias on q, k, v and o alike; out_bias must equal bias")
    hf = dict(base or {})
    hf.update(model_type=model_type, architectures=[ARCHITECTURES[model_type]], **to_hf_config(cfg))
    hf.pop("rope_scaling", None)
    hf.pop("rope_theta", None)
    if model_type == "llama":
        hf.update(attention_bias=attn.bias, mlp_bias=cfg.mlp_bias)
    return hf


def _permute_rope_rows(w: torch.Tensor, head_dim: int, inverse: bool) -> torch.Tensor:
    """Permute the rows of every head of a q/k weight (n * head_dim, ...) or bias between RoPE layouts."""
    perm = interleaved_to_half_split(head_dim)
    if inverse:
        perm = torch.argsort(perm)
    return w.reshape(-1, head_dim, *w.shape[1:])[:, perm].reshape(w.shape)


def hf_to_attnlab_key(
    key: str, layer_map: dict[str, str] = _LAYER_MAP, family: str = "Llama-family"
) -> str | None:
    """attnlab name of a Hugging Face tensor name; None for tensors that are not weights (``inv_freq``).
    ``layer_map``: the per-layer names (another decoder family shares the embedding/norm/head names)."""
    if _IGNORED.search(key):
        return None
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", key)
    if m and m.group(2) in layer_map:
        return f"layers.{m.group(1)}.{layer_map[m.group(2)]}.{m.group(3)}"
    stem, _, leaf = key.rpartition(".")
    if stem in _TOP_MAP:
        return f"{_TOP_MAP[stem]}.{leaf}"
    raise ValueError(f"unexpected tensor {key!r} in a {family} checkpoint")


def attnlab_to_hf_key(key: str, layer_map: dict[str, str] = _LAYER_MAP) -> str:
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", key)
    inverse_layer = {v: k for k, v in layer_map.items()}
    if m and m.group(2) in inverse_layer:
        return f"model.layers.{m.group(1)}.{inverse_layer[m.group(2)]}.{m.group(3)}"
    stem, _, leaf = key.rpartition(".")
    inverse_top = {v: k for k, v in _TOP_MAP.items()}
    if stem in inverse_top:
        return f"{inverse_top[stem]}.{leaf}"
    raise ValueError(f"no Hugging Face name for {key!r}")


def _is_rotary(name: str) -> bool:
    """Whether an attnlab tensor is rotated by RoPE (its rows depend on the layout): wq and wk."""
    return re.search(r"attention\.w[qk]\.", name) is not None


def state_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig, layout: str = "half_split") -> dict:
    """attnlab state dict from Hugging Face tensors (``load_llama`` checks its key set against the model)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    state = {}
    for key, value in tensors.items():
        name = hf_to_attnlab_key(key)
        if name is None:
            continue
        if layout == "interleaved" and _is_rotary(name):
            value = _permute_rope_rows(value, cfg.attention.head_dim, inverse=False)
        state[name] = value
    if cfg.tie_embeddings:
        state.setdefault("output.weight", state.get("tok_embeddings.weight"))
    return state


def state_to_hf(model: Transformer, layout: str = "half_split") -> dict[str, torch.Tensor]:
    """Hugging Face tensors of an attnlab model (``lm_head`` omitted when embeddings are tied)."""
    return state_dict_to_hf(model.state_dict(), model.cfg, layout)


def state_dict_to_hf(
    state: dict[str, torch.Tensor], cfg: ModelConfig, layout: str = "half_split"
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors of an attnlab state dict (e.g. gathered from a sharded model) of config ``cfg``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    out = {}
    for name, value in state.items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        value = value.detach()
        if layout == "interleaved" and _is_rotary(name):
            value = _permute_rope_rows(value, cfg.attention.head_dim, inverse=True)
        out[attnlab_to_hf_key(name)] = value.clone()
    return out


def load_llama(src: str | Path, layout: str = "half_split") -> Transformer:
    """An attnlab ``Transformer`` holding a Llama / Mistral / Qwen2 checkpoint (weights keep their dtype)."""
    hf = io.read_config(src)
    cfg = model_config_from_hf(hf)
    tensors, _ = io.read_tensors(src)
    return model_from_state(src, cfg, state_from_hf(tensors, cfg, layout))


def model_from_state(src: str | Path, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> Transformer:
    """A ``Transformer`` holding ``state`` (read from ``src``), whose key set must be exactly the model's."""
    head, table = state.get("output.weight"), state.get("tok_embeddings.weight")
    if cfg.tie_embeddings and head is not None and head is not table and not torch.equal(head, table):
        # transformers' rule: tie_word_embeddings with a separate LM head that differs from the embeddings keeps the
        # head (it does not tie them), so the checkpoint computes what transformers computes with it
        cfg = cfg.replace(tie_embeddings=False)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = set(model.state_dict())
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(
            f"{src}: checkpoint does not match its config; missing {missing[:4]}, extra {extra[:4]}"
        )
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as err:  # a tensor whose shape contradicts config.json
        detail = " ".join(str(err).split("\n", 1)[-1].split())
        raise ValueError(f"{src}: tensors do not match config.json: {detail}") from None
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval()


def save_llama(
    model: Transformer,
    dst: str | Path,
    model_type: str = "llama",
    *,
    base_config: dict | None = None,
    layout: str = "half_split",
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory (atomically); returns ``dst``."""
    hf = hf_config_from_model(model.cfg, model_type, base_config)
    tensors = state_to_hf(model, layout)
    with io.atomic_dir(dst, overwrite) as tmp:
        io.write_tensors(tmp, tensors)
        io.write_config(tmp, hf)
    return Path(dst)
