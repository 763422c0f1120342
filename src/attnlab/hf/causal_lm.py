"""Causal-LM checkpoints of every registered family behind one load and one save (``attnlab.families``).

``load_causal_lm(src)`` reads config.json, asks the registry for the family of its ``model_type``, reads the
``ModelConfig`` (the family's refusals for loading included), maps the tensors to attnlab's names with the family's
``TensorMap`` (named transforms split fused tensors) and builds ``attnlab.model.Transformer``.

``save_causal_lm(state, cfg, dst, like=src)`` writes new weights as a checkpoint of the same kind as ``src``: the
same config.json, tensor names, dtypes and shard files, every other file (tokenizer, generation config) copied, only
the weight values new. That is what training needs: the architecture is the source's and only the values moved.
Tensors of the source that no attnlab parameter maps to (buffers such as ``rotary_emb.inv_freq``, which the
loaders skip) are copied unchanged. ``save_model`` writes a new checkpoint of a family from a model alone (config
by the family's writer).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ..config import AttentionConfig, ModelConfig
from ..families import FAMILIES, Family, causal_lm_types, family
from ..families.base import Fields
from ..model import Transformer
from . import io


def family_of(src: str | Path) -> str:
    """The ``model_type`` of a checkpoint directory, checked to be a causal-LM family attnlab loads."""
    return _family(io.read_config(src), src)[0]


def _family(hf: dict, src: str | Path) -> tuple[str, Family]:
    model_type = hf["model_type"]
    found = FAMILIES.get(model_type)
    if found is None or not found.causal_lm or found.tensors is None:
        raise ValueError(
            f"unsupported model_type {model_type!r} in {Path(src) / 'config.json'}; causal-LM families: "
            f"{', '.join(causal_lm_types())}"
        )
    return model_type, found


def model_config(src: str | Path, hf: dict | None = None) -> ModelConfig:
    """The ``ModelConfig`` of a causal-LM checkpoint, after the family's checks for loading."""
    hf = io.read_config(src) if hf is None else hf
    model_type, fam = _family(hf, src)
    fields = Fields(hf, model_type, str(Path(src) / "config.json"))
    return fam.config(fields, loading=True)


def load_causal_lm(src: str | Path) -> nn.Module:
    """The attnlab model of a causal-LM checkpoint (weights keep the checkpoint's dtype), checked to hold only
    finite weights."""
    hf = io.read_config(src)
    cfg = model_config(src, hf)
    tensors, _ = io.read_tensors(src)
    fam = family(hf["model_type"])
    state = _attnlab_state(src, hf, cfg, tensors)
    if fam.gqa == "repeated":  # a GQA model in the MHA layout is loaded as the GQA model it computes
        cfg, state = collapse_repeated_kv_heads(cfg, state)
    theirs = fam.tensor_map(hf).theirs
    model = model_from_state(src, cfg, state, theirs)
    io.check_finite(model, src, theirs)
    return model


def _attnlab_state(
    src: str | Path, hf: dict, cfg: ModelConfig, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The attnlab state dict of checkpoint ``tensors`` (the family's tensor map of config.json ``hf``)."""
    try:
        return family(hf["model_type"]).tensor_map(hf).to_attnlab(tensors, cfg)
    except ValueError as err:  # an unexpected or misshapen tensor: named with the checkpoint it is in
        raise ValueError(f"{src}: {err}") from None


def check_causal_lm(src: str | Path, hf: dict | None = None) -> None:
    """What ``load_causal_lm`` checks of the tensors' names, shapes and dtypes against config.json (``hf``, read
    from ``src`` when not given), on the weight files' headers alone (meta tensors: nothing is read or allocated):
    for a command whose jobs load the weights (``attnlab sweep``, each of whose rows failed on a checkpoint missing
    one tensor, with exit 0). Values are not read: finiteness, and equal repeated KV heads, are the load's to
    check."""
    hf = io.read_config(src) if hf is None else hf
    cfg = model_config(src, hf)
    state = _attnlab_state(src, hf, cfg, io.check_weights(src))
    io.assign(src, lambda: Transformer(cfg), state, family(hf["model_type"]).tensor_map(hf).theirs)


def model_from_state(
    src: str | Path,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    theirs: Callable[[str], str] | None = None,
) -> Transformer:
    """A ``Transformer`` holding ``state`` (read from ``src``), whose key set must be exactly the model's (errors
    name the checkpoint's tensors by ``theirs``, as ``io.assign``)."""
    head, table = state.get("output.weight"), state.get("tok_embeddings.weight")
    if cfg.tie_embeddings and head is not None and head is not table and not torch.equal(head, table):
        # transformers' rule: tie_word_embeddings with a separate LM head that differs from the embeddings keeps the
        # head (it does not tie them), so the checkpoint computes what transformers computes with it
        cfg = cfg.replace(tie_embeddings=False)
    if cfg.tie_embeddings and theirs is not None:  # the head is the embedding: no file holds lm_head
        embedding, named = theirs("tok_embeddings.weight"), theirs
        theirs = lambda name: embedding if name == "output.weight" else named(name)  # noqa: E731
    model = io.assign(src, lambda: Transformer(cfg), state, theirs)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval()


def checkpoint_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig, hf: dict) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of an attnlab state dict, in the layout of the family of config.json ``hf``."""
    return family(hf["model_type"]).tensor_map(hf).to_checkpoint(state, cfg)


def _tensor_meta(
    src: Path, files: dict[str, str], written: set[str]
) -> dict[str, tuple[torch.dtype | None, tuple[int, ...]]]:
    """(dtype, shape) of each tensor; the ``written`` ones must have a float dtype (the others, buffers such as
    GPT-NeoX's boolean causal mask, are copied as they are: dtype None)."""
    meta = {}
    for name in sorted(set(files.values())):
        with safe_open(src / name, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                piece = f.get_slice(key)
                dtype = piece.get_dtype()
                if dtype not in io.FLOAT_DTYPES and key in written:
                    raise ValueError(f"{src / name}: tensor {key} has dtype {dtype}, not a float type")
                meta[key] = (io.FLOAT_DTYPES.get(dtype), tuple(piece.get_shape()))
    return meta


def save_causal_lm(
    state: dict[str, torch.Tensor],
    cfg: Any,
    dst: str | Path,
    *,
    like: str | Path,
    overwrite: bool = False,
    extra_files: dict[str, str] | None = None,
    sources: tuple[str | Path | None, ...] = (),
) -> Path:
    """Write the attnlab state dict ``state`` (of a model with config ``cfg``) as a checkpoint like ``like``.

    ``extra_files``: name -> text written beside the weights (e.g. a training log). Atomic: ``dst`` appears
    complete or not at all. ``sources``: inputs besides ``like`` that ``dst`` may not be, contain or lie inside.
    Returns ``dst``.
    """
    like, dst = Path(like), Path(dst)
    hf = io.read_config(like)
    _, fam = _family(hf, like)
    attn = cfg.attention
    if fam.gqa == "repeated" and isinstance(attn, AttentionConfig) and attn.n_rep > 1:
        # written as it was read (load_causal_lm): each KV head repeated for its group, in the MHA layout
        state = repeat_kv_heads(state, attn)
        cfg = cfg.replace(attention=attn.replace(n_kv_heads=attn.n_heads))
    new = checkpoint_tensors(state, cfg, hf)
    files = io.shard_map(like)
    if cfg.tie_embeddings and "tok_embeddings.weight" in state:
        # a tied model whose source also holds its head (some published tied checkpoints do): the head is written
        # as the embedding it is tied to, not copied from the source (trained, they differ, and transformers then
        # reads the stale head as an untied one)
        untied = cfg.replace(tie_embeddings=False)
        head = checkpoint_tensors({**state, "output.weight": state["tok_embeddings.weight"]}, untied, hf)
        new |= {key: head[key] for key in set(head) - set(new) if key in files}
    meta = _tensor_meta(like, files, set(new))
    unknown = sorted(set(new) - set(files))
    if unknown:
        raise ValueError(f"{like} has no tensors {unknown[:4]}: the model does not have its architecture")
    tensors: dict[str, torch.Tensor] = {}
    kept = {}
    for key in files:
        dtype, shape = meta[key]
        if key not in new:
            kept[key] = files[key]
            continue
        if tuple(new[key].shape) != shape:
            raise ValueError(f"tensor {key}: shape {tuple(new[key].shape)}, but {like} has {shape}")
        tensors[key] = new[key].detach().to("cpu", dtype).contiguous()
    for name in sorted(set(kept.values())):  # buffers the loaders skip: copied as they are
        with safe_open(like / name, framework="pt") as f:
            for key in (k for k, v in kept.items() if v == name):
                tensors[key] = f.get_tensor(key)
    weight_files = set(files.values()) | {io.INDEX}
    with io.atomic_dir(dst, overwrite, sources=(like, *sources), what="DST") as tmp:
        io.write_tensors(tmp, tensors, files, like=like)
        # config.json, tokenizer files, generation config: unchanged.
        io.copy_other_files(like, tmp, skip=weight_files | set(extra_files or {}))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return dst


def save_model(
    model: Transformer,
    dst: str | Path,
    model_type: str,
    *,
    base_config: dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as a new checkpoint of ``model_type`` (config.json by the family's writer from
    ``base_config``, e.g. the source's; one model.safetensors), atomically; returns ``dst``."""
    fam = family(model_type)
    if fam.write is None or fam.tensors is None:
        raise ValueError(f"attnlab does not write {model_type} checkpoints")
    hf = fam.write(model.cfg, dict(base_config or {}) | {"model_type": model_type})
    return io.write_checkpoint(dst, checkpoint_tensors(model.state_dict(), model.cfg, hf), hf, overwrite)


def repeat_kv_heads(state: dict[str, torch.Tensor], attn: AttentionConfig) -> dict[str, torch.Tensor]:
    """A GQA state dict in the MHA layout: each KV head's key and value rows (``attention.wk``/``wv`` weights and
    biases) repeated for the query heads of its group, which computes the GQA model exactly (how a family whose
    class has no KV-head field, ``Family.gqa == "repeated"``, is written)."""
    out = dict(state)
    for name in _kv_rows(state):
        heads = state[name].reshape(attn.n_kv_heads, attn.head_dim, *state[name].shape[1:])
        out[name] = heads.repeat_interleave(attn.n_rep, 0).flatten(0, 1)
    return out


def _kv_rows(state: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in state if re.search(r"attention\.w[kv]\.(weight|bias)$", name)]


def collapse_repeated_kv_heads(
    cfg: ModelConfig, state: dict[str, torch.Tensor]
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The GQA model that an MHA-layout state computes when its KV heads come in groups of equal ones (what
    ``repeat_kv_heads`` writes, and ``attnlab convert`` for a family whose class has no KV-head field): its config
    with the fewest KV heads whose repetition the state is, bit for bit in every layer, and the state with one head
    of each group. Training then keeps each group one head, as the GQA model has it; an MHA model (no two heads
    equal) is returned as it is."""
    attn = cfg.attention
    if not isinstance(attn, AttentionConfig) or attn.n_kv_heads != attn.n_heads:
        return cfg, state
    rows = _kv_rows(state)
    for n_kv in range(1, attn.n_heads):
        if attn.n_heads % n_kv:
            continue
        groups = {n: state[n].reshape(n_kv, attn.n_heads // n_kv, -1) for n in rows}
        if rows and all(bool((g == g[:, :1]).all()) for g in groups.values()):
            one = {n: g[:, 0].reshape(n_kv * attn.head_dim, *state[n].shape[1:]) for n, g in groups.items()}
            return cfg.replace(attention=attn.replace(n_kv_heads=n_kv)), state | one
    return cfg, state
