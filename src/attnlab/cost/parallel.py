"""Tensor parallelism by heads, costed per rank (pure functions of the configs).

The rules are those ``attnlab.parallel.apply_tp`` shards by (Megatron-LM's layout, Shoeybi et al. 2019, arXiv
1909.08053): each of ``tp`` ranks computes n_heads / tp query heads; it holds n_kv_heads / tp KV heads, or, when
tp > n_kv_heads, the one KV head its query heads read, which tp / n_kv_heads ranks then hold and cache (MQA: all
of them); an MLA rank holds its heads' share of the query projection, ``wkv_b`` and ``wo`` but the whole latent
projection, and caches the whole latent. The MLP (and each expert) is split over its hidden units, the
embedding and LM head over the vocabulary (a tied table stays whole, as apply_tp leaves it); norms and learned
position embeddings are replicated. ``rank_config`` writes one rank's share as a ``ModelConfig``, so every
count of the cost model (parameters, FLOPs, KV bytes, bytes a step reads) is also a per-rank count.

Communication per forward (Megatron-LM, Sec. 3): one all-reduce of the activations (d_model values per token)
after each attention and each MLP; with a split vocabulary one more after the embedding and an all-gather of
the logits that are sampled. A ring moves ``2 (tp - 1) / tp`` times an all-reduce's payload through every
rank's link in each direction (``(tp - 1) / tp`` for an all-gather): Patarasuk and Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009; the "bus bandwidth" of NVIDIA's nccl-tests.
A ring spanning nodes goes at the slower network's pace. The roofline adds this time to the step's (a tensor
parallel step waits for its all-reduces); the fixed latency of each collective is not modelled (it adds
``collectives_per_step`` times a few microseconds on NVLink).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import AttentionConfig, MLAConfig, ModelConfig
from .hardware import Hardware
from .memory import _bits_to_bytes, activation_dtype, dtype_bits


def check_tp(cfg: AttentionConfig | MLAConfig | ModelConfig, tp: int, *, flag: str = "tp") -> None:
    """ValueError unless ``cfg``'s heads can be split over ``tp`` ranks: tp divides n_heads and, for MHA / GQA /
    MQA, divides n_kv_heads or is a multiple of it. ``flag``: how messages name tp (the CLI's ``--tp``)."""
    given = f"{flag} {tp}" if flag.startswith("--") else f"{flag}={tp}"
    if isinstance(tp, bool) or not isinstance(tp, int):
        raise TypeError(f"{flag} must be an int, got {tp!r}")
    if tp < 1:
        raise ValueError(f"{given} must be >= 1")
    attn = cfg.attention if isinstance(cfg, ModelConfig) else cfg
    if not isinstance(attn, (AttentionConfig, MLAConfig)):
        raise TypeError(f"cfg must be an AttentionConfig, MLAConfig or ModelConfig, got {type(cfg).__name__}")
    cli = flag.startswith("--")
    if attn.n_heads % tp:
        heads = f"the model's {attn.n_heads} query heads" if cli else f"n_heads={attn.n_heads}"
        raise ValueError(f"{given} must divide {heads}: each rank computes whole query heads")
    if isinstance(attn, AttentionConfig) and attn.n_kv_heads % tp and tp % attn.n_kv_heads:
        heads = f"the model's {attn.n_kv_heads} KV heads" if cli else f"n_kv_heads={attn.n_kv_heads}"
        raise ValueError(
            f"{given} must divide {heads} (each rank holds n_kv_heads / tp KV heads) or be a multiple of it (each "
            "KV head replicated on tp / n_kv_heads ranks)"
        )


def kv_heads_per_rank(cfg: AttentionConfig | MLAConfig, tp: int) -> int:
    """KV heads a rank holds and caches: n_kv_heads / tp, or 1 (a replicated head; for MLA, the latent)."""
    check_tp(cfg, tp)
    return max(cfg.n_kv_heads // tp, 1) if isinstance(cfg, AttentionConfig) else 1


def kv_replicas(cfg: AttentionConfig | MLAConfig, tp: int) -> int:
    """Ranks that hold and cache each KV head: 1 when KV heads are split, tp / n_kv_heads when replicated, tp for
    MLA's latent."""
    check_tp(cfg, tp)
    return max(tp // cfg.n_kv_heads, 1) if isinstance(cfg, AttentionConfig) else tp


def _ceil_div(n: int, tp: int) -> int:
    return -(-n // tp)  # torch.chunk's split (and DTensor's Shard): the first ranks hold ceil(n / tp)


def rank_config(model_cfg: ModelConfig, tp: int) -> ModelConfig:
    """One rank's share of ``model_cfg`` at tensor-parallel size ``tp``, as a config (the largest share where a
    size does not divide: the first ranks hold ceil(n / tp) hidden units or vocabulary rows)."""
    if not isinstance(model_cfg, ModelConfig):
        raise TypeError(f"model_cfg must be a ModelConfig, got {type(model_cfg).__name__}")
    check_tp(model_cfg, tp)
    if tp == 1:
        return model_cfg

    def local(attn: AttentionConfig | MLAConfig) -> AttentionConfig | MLAConfig:
        if isinstance(attn, AttentionConfig):
            return attn.replace(
                n_heads=attn.n_heads // tp, n_kv_heads=kv_heads_per_rank(attn, tp), head_dim=attn.head_dim
            )
        return attn.replace(n_heads=attn.n_heads // tp)

    # every kind of layer's attention (a sliding layer's is its own config)
    return model_cfg.map_attention(local).replace(
        ffn_dim=_ceil_div(model_cfg.ffn_dim, tp),
        moe_ffn_dim=_ceil_div(model_cfg.moe_ffn_dim, tp),
        vocab_size=model_cfg.vocab_size if model_cfg.tie_embeddings else _ceil_div(model_cfg.vocab_size, tp),
        name=f"{model_cfg.name} (1 of tp={tp})" if model_cfg.name else "",
    )


def allreduce_bytes_per_token_per_layer(
    model_cfg: ModelConfig, dtype: str | torch.dtype = "bf16", hw: Hardware | None = None
) -> int:
    """Payload all-reduced per token per layer in a forward: the attention's and the MLP's output, d_model
    values each (zero without tensor parallelism; a backward all-reduces as much again, for the input gradients),
    in the activations' dtype (bf16 for weights stored in int8, fp6 or int4, and on a device ``hw`` without a rate
    of its own for ``dtype``: ``activation_dtype``)."""
    return _bits_to_bytes(2 * model_cfg.d_model * dtype_bits(activation_dtype(dtype, hw)))


@dataclass(frozen=True)
class TPComm:
    """What one forward step sends between the ``tp`` ranks, and how long the ring takes on a ``Hardware``."""

    allreduce_bytes: (
        int  # payload of all the step's all-reduces (layers and, with a split vocabulary, embedding)
    )
    allgather_bytes: int  # the sampled logits gathered from the vocabulary shards
    collectives: int  # collectives per step: the count a per-collective latency would multiply
    link_bandwidth: float  # bytes/s per direction on the slowest hop of the ring
    seconds: float


def tp_comm(
    model_cfg: ModelConfig,
    hw: Hardware,
    tp: int,
    *,
    tokens: int,
    sampled: int,
    dtype: str | torch.dtype = "bf16",
) -> TPComm:
    """The collectives of one forward over ``tokens`` tokens of which ``sampled`` get logits (prefill: one per
    sequence; decode: every token), on ``hw``'s links; zero at tp = 1 (see the module docstring)."""
    check_tp(model_cfg, tp)
    if tp == 1:
        return TPComm(0, 0, 0, 0.0, 0.0)
    if hw.link_bandwidth is None:
        raise ValueError(
            f"hardware {hw.name!r} has no interconnect figures: tensor parallelism (tp={tp}) is not modelled on it"
        )
    split_vocab = not model_cfg.tie_embeddings
    n_allreduce = 2 * model_cfg.n_layers + (1 if split_vocab else 0)
    # activations and logits: dequantised weights (and dtypes the device has no rate for) compute in bf16
    bits = dtype_bits(activation_dtype(dtype, hw))
    allreduce = _bits_to_bytes(n_allreduce * tokens * model_cfg.d_model * bits)
    allgather = _bits_to_bytes(sampled * model_cfg.vocab_size * bits) if split_vocab else 0
    within_node = tp <= hw.gpus_per_node or hw.network_bandwidth is None
    link = hw.link_bandwidth if within_node else min(hw.link_bandwidth, hw.network_bandwidth)
    moved = 2 * (tp - 1) / tp * allreduce + (tp - 1) / tp * allgather  # through each rank's link, each way
    return TPComm(allreduce, allgather, n_allreduce + (1 if split_vocab else 0), link, moved / link)
