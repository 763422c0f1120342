"""On-disk conversion of a checkpoint whose family allows it (its ``Family.mla`` verdict is not "refused": Llama,
Mistral, Qwen2, Phi-3, GLM, ChatGLM, each on the config's terms, docs/families.md) to a native, dense DeepSeek-V3
(MLA) checkpoint.

Steps: load the source (``load_causal_lm``) in float32; convert every attention layer to MLA
(``convert.convert_model_to_mla``: RoPE kept on the chosen planes after RoRoPE, the rest factored into the
latent); add DeepSeek's latent norm (``convert.fold_latent_norms``); write ``DeepseekV3ForCausalLM`` weights
(``hf.deepseek``, each tensor in its source tensor's dtype: ``written_dtypes``) atomically, with every other file of
the source (tokenizer, generation config) copied. The source is only read.

Calibration: ``calib`` is a UTF-8 text file, tokenised with the source's ``tokenizer.json`` as for
``attnlab convert --kv-heads`` (``hf.checkpoint.calibration_batches``). Without it, random token ids (seeded)
stand in: enough to set the scale of the latent norm, but a poor guide to what the model attends to.
The summary reports the error of every step on the calibration batches.

Destination rules are ``attnlab.atomic``'s (checked before anything is loaded): not the source, not inside it,
not containing it; an existing one only with ``overwrite``. Weight files of the source that the conversion did
not write (other formats, other safetensors) are left out and listed in the summary.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from .. import resources
from ..atomic import check_destination
from ..config import AttentionConfig, ModelConfig
from ..convert.mla import (
    check_target,
    plain_planes,
    rope_obstacle,
    rope_planes,
    source_frequencies,
    stride_limit,
)
from ..convert.mla_model import (
    choose_stride,
    convert_model_to_mla,
    fold_latent_norms,
    layer_errors,
    logit_distances,
    with_nope_dim,
)
from ..families import family
from ..families.base import MLASupport, mlp_obstacle
from . import deepseek, io
from .causal_lm import load_causal_lm, model_config
from .checkpoint import calibration_batches, check_calib, computing_on, conversion_device, on_device

# (stage, layers done, layers in all): called after each layer of each pass over the model
StageProgress = Callable[[str, int, int], None]
STAGES = ("choosing planes", "converting", "latent norm", "measuring errors", "comparing logits")
UNITS = dict(zip(STAGES, ("layers",) * 4 + ("batches",), strict=True))  # what each stage's progress counts


def random_batches(
    vocab_size: int, seed: int, n: int = 4, batch: int = 4, length: int = 64
) -> list[torch.Tensor]:
    """Token-id batches drawn uniformly from the vocabulary: calibration when no text is given."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (batch, length), generator=gen) for _ in range(n)]


def written_dtypes(native: torch.nn.Module, source: dict[str, torch.dtype]) -> dict[str, torch.dtype]:
    """The dtype each parameter of the MLA model ``native`` is written in, from ``source`` (the source model's
    parameter name -> dtype): a tensor the conversion kept (embeddings, norms, MLPs, ``wq``, ``wo``) keeps its own; a
    new one takes its layer's counterpart's, the latent norm the attention norm's and a projection ``wq``'s. A
    bfloat16 checkpoint with float32 norms stays one, as the GQA conversion and uptrain write it."""
    fallback = source["tok_embeddings.weight"]
    dtypes = {}
    for name, _ in native.named_parameters():
        if name in source:
            dtypes[name] = source[name]
            continue
        layer, _, rest = name.partition(".attention.")
        kin = f"{layer}.attention_norm.weight" if "norm" in rest else f"{layer}.attention.wq.weight"
        dtypes[name] = source.get(kin, fallback)
    return dtypes


def _stage(progress: StageProgress | None, stage: str) -> Callable[[int, int], None] | None:
    return None if progress is None else lambda done, total: progress(stage, done, total)


def _full_context(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` without its sliding layers when their window covers every position it takes (Mistral or Phi-3 with a
    ``sliding_window`` of at least ``max_position_embeddings``, as the families' verdicts read it): full attention,
    which MLA has. They were refused for the window that an MLA layer has no field for."""
    if cfg.sliding is None or cfg.sliding.window < cfg.max_seq_len:
        return cfg
    return cfg.replace(sliding=None, layer_types=())


def check_inputs(
    src: Path,
    kv_lora_rank: int,
    rope_dim: int | None,
    planes: str | int | None,
    calib: str | Path | None = None,
    device: str = "auto",
) -> tuple[dict, ModelConfig, MLASupport, int]:
    """Every check of an MLA conversion's inputs that reads no more than SRC's config.json: --device, SRC itself, its
    family's verdict, the rank, --rope-dim, a --planes stride, --calib (the file, not yet its lines). ``attnlab
    convert`` runs them before it looks at DST (a refused source or rank was reported as "destination exists");
    returns SRC's config.json, its config, its family's verdict and the rope_dim the conversion keeps."""
    conversion_device(device, True, "--to mla")
    hf = io.read_config(src)
    io.copy_other_files(src, None)  # a broken link among the files to copy: refused before any work
    cfg = _full_context(model_config(src, hf))  # a causal-LM family attnlab loads, with its checks
    support = family(hf["model_type"]).mla(cfg)
    if support.verdict == "refused" or not isinstance(cfg.attention, AttentionConfig):
        raise ValueError(f"--to mla: a {hf['model_type']} model cannot be converted to MLA: {support.note}")
    # what the family's verdict cannot see: a scaling that keeps no plane, MLPs DeepSeek-V3 does not have
    obstacle = rope_obstacle(cfg.attention) or mlp_obstacle(cfg)
    if obstacle:
        raise ValueError(f"--to mla: a {hf['model_type']} model cannot be converted to MLA: {obstacle}")
    attn_cfg = cfg.attention
    flags = {"kv_lora_rank": "--kv-lora-rank", "rope_dim": "--rope-dim"}  # the command's names in messages
    rope_dim = check_target(attn_cfg, kv_lora_rank, rope_dim, names=flags)
    plain = plain_planes(attn_cfg) if attn_cfg.rope else 0
    if isinstance(planes, int) and attn_cfg.rope:
        high = stride_limit(attn_cfg, rope_dim, flags["rope_dim"])
        if not 1 <= planes <= high:
            band = ""
            if plain < attn_cfg.rotary_dim // 2:  # a scaled RoPE: only its plain planes can keep RoPE exactly
                band = (
                    f", whose rope_type {attn_cfg.rope_type!r} turns only planes 0..{plain - 1} at plain "
                    "RoPE frequencies (what a DeepSeek export computes)"
                )
            raise ValueError(
                f"--planes {planes}: a stride must be in [1, {high}] for --rope-dim {rope_dim} of the "
                f"{attn_cfg.rotary_dim} dims the source's RoPE turns{band}"
            )
    if calib is not None:
        check_calib(src, calib)
    return hf, cfg, support, rope_dim


def convert_checkpoint_to_mla(
    src: str | Path,
    dst: str | Path,
    kv_lora_rank: int,
    rope_dim: int | None = None,
    *,
    calib: str | Path | None = None,
    planes: str | int | None = None,
    rorope: bool = True,
    weighting: str = "readers",
    mean_phase: bool = True,
    balance: bool = True,
    overwrite: bool = False,
    seed: int = 0,
    progress: StageProgress | None = None,
    device: str = "auto",
) -> dict:
    """Convert the checkpoint in ``src`` (a family whose MLA verdict allows it) to a DeepSeek-V3 MLA checkpoint in
    ``dst``; returns a summary (shapes, KV values per token before/after, rotary planes kept, per-layer errors,
    logit distances). ``planes``, ``rorope``, ``weighting``, ``mean_phase``: as ``convert.convert_model_to_mla``;
    ``balance``: as ``convert.fold_latent_norms``. ``progress(stage, done, total)`` is called after each layer of each pass
    (``STAGES``).

    Bad targets (a rank above what the layer can use, a rope_dim that is odd or larger than head_dim, a
    rope_dim or stride that would keep a plane the source's llama3 / yarn scaling changes) raise ValueError
    before anything is written. ``device``: where the model runs (``resources.resolve_device``); tensors are written
    from the CPU.
    """
    src, dst = Path(src), Path(dst)
    hf, cfg, support, rope_dim = check_inputs(src, kv_lora_rank, rope_dim, planes, calib, device)
    attn_cfg = cfg.attention
    plain = plain_planes(attn_cfg) if attn_cfg.rope else 0
    where = conversion_device(device, True, "--to mla")
    # Checked again when writing; here so that a refused destination costs no loading.
    check_destination(dst, (src, calib), overwrite=overwrite)  # --calib is an input too
    model = load_causal_lm(src)
    if model.cfg.sliding is not None and cfg.sliding is None:  # its windows cover every position: dropped
        model.cfg = cfg
        for layer in model.layers:
            layer.attention.cfg = layer.attention.cfg.replace(window=None)
    source_dtypes = {name: p.dtype for name, p in model.named_parameters()}
    model = model.float().to(where)
    if calib is not None:
        batches = calibration_batches(src, calib, vocab_size=cfg.vocab_size, max_positions=cfg.max_seq_len)
    else:  # no longer than the positions the model was made for (drawn on the CPU: the same ids on any device)
        batches = random_batches(cfg.vocab_size, seed, length=min(64, cfg.max_seq_len))
    batches = on_device(batches, where)

    resources.announce_device(where)
    with computing_on(where):
        stride = choose_stride(
            model, rope_dim, planes, calib=batches, rorope=rorope, progress=_stage(progress, STAGES[0])
        )
        mla = convert_model_to_mla(
            model,
            kv_lora_rank,
            rope_dim,
            calib=batches,
            planes=stride,
            rorope=rorope,
            weighting=weighting,
            mean_phase=mean_phase,
            progress=_stage(progress, STAGES[1]),
        )
        native, norm_stats = fold_latent_norms(
            mla, batches, balance=balance, progress=_stage(progress, STAGES[2])
        )
        errors = layer_errors(model, mla, batches, progress=_stage(progress, STAGES[3]))
        summary = {
            "src": str(src),
            "dst": str(dst),
            "model_type": hf["model_type"],
            "mla_conversion": support.verdict,  # exact or approximate, for this family (attnlab.families)
            "mla_conversion_note": support.note,
            "n_layers": cfg.n_layers,
            "n_heads": attn_cfg.n_heads,
            "n_kv_heads_before": attn_cfg.n_kv_heads,
            "head_dim": attn_cfg.head_dim,
            # the dims RoPE turns (partial rotary: the rest go to the nope part as they are) and how they pair
            "source_rotary_dim": attn_cfg.rotary_dim if attn_cfg.rope else 0,
            "source_rope_interleaved": attn_cfg.rope_interleaved if attn_cfg.rope else False,
            "kv_lora_rank": kv_lora_rank,
            "qk_rope_head_dim": rope_dim,
            "qk_nope_head_dim": native.cfg.attention.qk_nope_head_dim,
            "source_rope_type": attn_cfg.rope_type if attn_cfg.rope else None,
            # planes 0..n-1 turn at plain RoPE frequencies (all of them without scaling): those that can keep RoPE
            "source_plain_planes": plain,
            # yarn's factor on cos and sin, folded into q_proj as its square (1: none)
            "source_attention_factor": source_frequencies(attn_cfg)[1] if attn_cfg.rope else 1.0,
            "rope_stride": stride,
            "rope_planes": rope_planes(attn_cfg.rotary_dim, rope_dim, stride, planes=plain).tolist()
            if attn_cfg.rope
            else [],
            "rope_theta": native.cfg.attention.rope_theta,
            "kv_values_per_token_before": 2 * cfg.n_layers * attn_cfg.n_kv_heads * attn_cfg.head_dim,
            "kv_values_per_token_after": cfg.n_layers * native.cfg.attention.cache_dim,
            "calibration": str(calib) if calib is not None else "random tokens",
            "device": str(where),
            "layer_output_error": [round(e["output_error"], 6) for e in errors],
            "layer_score_error": [round(e["score_error"], 6) for e in errors],
            "latent_norm_error": [round(s["latent_error"], 6) for s in norm_stats],
            "latent_norm_balance": [s["balance"] for s in norm_stats],
            # Logit distances on the calibration batches: conversion alone, the latent norm alone, both.
            **{
                f"logits_{x}_vs_{y}": d
                for (x, y), d in logit_distances(
                    {"source": model, "mla": mla, "native": native},
                    [("source", "mla"), ("mla", "native"), ("source", "native")],
                    batches,
                    progress=_stage(progress, STAGES[4]),
                ).items()
            },
        }
        # llama.cpp loads no DeepSeek model without a no-RoPE dim: a one-KV-head source keeping every dim rotary gets a
        # zero one (the same model; its distances above are those of the model without it)
        native = with_nope_dim(native)
        summary["qk_nope_head_dim"] = native.cfg.attention.qk_nope_head_dim
    native = native.cpu()
    dtypes = written_dtypes(native, source_dtypes)
    with torch.no_grad():
        for name, p in native.named_parameters():
            p.data = p.data.to(dtypes[name])
    tensors = deepseek.state_to_hf(native)
    files = set(io.shard_map(src).values()) | {io.INDEX, "config.json"}
    with io.atomic_dir(dst, overwrite, sources=(src, calib)) as tmp:
        io.write_tensors(tmp, tensors)
        io.write_config(tmp, deepseek.hf_config_from_model(native.cfg, hf))
        # weight files of the source (other formats, other safetensors) that would contradict the new weights
        summary["files_left_out"] = io.copy_other_files(src, tmp, skip=files)
    return summary
