"""On-disk conversion of a Hugging Face checkpoint to fewer KV heads: ``attnlab convert --to gqa`` (the default).

A causal LM of any registered family (``attnlab.families``) is loaded, converted in attnlab, and written back through
its family: its config.json by the family's writer (the KV-head field lowered; and ``tie_word_embeddings`` written
false where the source ties them but holds a head of its own, which transformers then keeps untied too: the
loaded model's reading, made explicit), and the checkpoint tensors made from attnlab tensors the conversion changed
(``k_proj``/``v_proj``, or a fused QKV tensor at the new width; the data-aware "fit" methods also change the queries
and the output projection) rewritten; every other tensor and file is copied bit for bit, and each weight file and
the index keep their metadata. A family whose class has no KV-head field (``Family.gqa ==
"repeated"``) is written in the MHA layout with each KV head repeated for its group, which computes the GQA model
exactly. BERT: converted in attnlab, written in that MHA layout (see ``attnlab.hf.bert``).

Calibration (``calib``, for "fit" and "grouped-fit"): a UTF-8 text file; each non-empty line (up to 256) is
tokenised with the source's ``tokenizer.json``; lines are run in right-padded batches and padded positions are
left out of the statistics.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from .. import data, resources
from ..atomic import check_destination
from ..convert.gqa import METHODS
from ..convert.model import DATA_AWARE, Progress, convert_model
from ..families import FAMILIES, Family, family
from ..hf_config import from_hf_config
from . import bert, io
from .causal_lm import load_causal_lm, repeat_kv_heads


def check_calib(src: Path, calib: str | Path) -> Path:
    """``--calib`` as a file that SRC's tokenizer can read (its lines are read later)."""
    calib = Path(calib)
    if not calib.is_file():
        if calib.is_symlink() and not calib.exists():  # a link that leads nowhere, or round in a loop
            try:
                calib.resolve(strict=True)
            except (RuntimeError, OSError) as err:
                raise ValueError(f"--calib {calib}: the path does not resolve ({err})") from None
        if calib.exists():  # a directory: "not found" sent users looking for a missing path
            raise ValueError(
                f"--calib {calib} is not a text file (one calibration text, one sequence a line)"
            )
        raise FileNotFoundError(f"--calib {calib}: calibration file not found")
    if not (src / "tokenizer.json").is_file():
        raise ValueError(f"--calib needs a tokenizer.json in {src} to tokenise {calib}")
    return calib


def calibration_batches(
    src: Path,
    calib: str | Path,
    max_lines: int = 256,
    max_tokens: int = 128,
    batch_size: int = 16,
    vocab_size: int | None = None,
    max_positions: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Padded batches ``(ids, mask)`` of the lines of the text file ``calib``, tokenised with the source's
    ``tokenizer.json`` (checked against the model's ``vocab_size``), each line at most ``max_tokens`` tokens and
    no longer than the ``max_positions`` the model was made for; padding is on the right (what
    ``convert_model`` needs for causal decoders)."""
    if max_positions is not None:
        max_tokens = min(max_tokens, max_positions)
    calib = check_calib(src, calib)
    tok = data.load_tokenizer(src, vocab_size)
    tok.no_padding()
    tok.enable_truncation(max_tokens)
    text = data.read_text(calib, "--calib")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    seqs = sorted((ids for ids in (tok.encode(line).ids for line in lines[:max_lines]) if ids), key=len)
    if not seqs:
        raise ValueError(f"--calib {calib}: the calibration file has no usable lines")
    batches = []
    for i in range(0, len(seqs), batch_size):  # sorted by length, so that little padding is needed
        chunk = seqs[i : i + batch_size]
        width = len(chunk[-1])
        ids = torch.tensor([s + [0] * (width - len(s)) for s in chunk])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk])
        batches.append((ids, mask))
    return batches


def conversion_device(device: str, computes: bool, what: str) -> torch.device:
    """Where a conversion runs its model: ``--device`` (``resources.resolve_device``) when it ``computes``
    (calibration forward passes), else the CPU (weight arithmetic alone; an explicit GPU is refused rather than
    silently unused)."""
    where = resources.resolve_device(device)
    if not computes and where.type != "cpu":
        if device.strip().lower() != "auto":
            raise ValueError(
                f"--device {device}: {what} runs no model, only arithmetic on the weights (on the CPU); --device "
                "applies to --method fit / grouped-fit and --to mla"
            )
        where = torch.device("cpu")
    return where


def on_device(batches: list, device: torch.device) -> list:
    """Calibration batches (tensors, or ``(ids, mask)`` pairs) moved to ``device``."""
    return [tuple(t.to(device) for t in b) if isinstance(b, tuple) else b.to(device) for b in batches]


def computing_on(device: torch.device) -> contextlib.AbstractContextManager:
    """The conversion's own tensors (``arange``, ``eye``, ``zeros`` made without a device) are made on a GPU that
    runs it, where they meet the model's activations (torch's default-device context); on the CPU nothing changes."""
    return contextlib.nullcontext() if device.type == "cpu" else device


def _gqa_types() -> str:
    return ", ".join(
        t for t, f in FAMILIES.items() if f.gqa is not None and (f.tensors is not None or not f.causal_lm)
    )


def check_kv_heads(n_heads: int, n_kv_src: int, n_kv_heads: int) -> None:
    if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int):
        raise TypeError(f"n_kv_heads (--kv-heads) must be an int, got {n_kv_heads!r}")
    if n_kv_heads < 1 or n_kv_src % n_kv_heads:
        raise ValueError(
            f"--kv-heads {n_kv_heads} must be a positive divisor of the checkpoint's {n_kv_src} KV heads "
            f"({n_heads} query heads)"
        )


def check_inputs(
    src: Path, n_kv_heads: int, method: str, calib: str | Path | None, device: str = "auto"
) -> tuple[dict, Family]:
    """Every check of a GQA conversion's inputs that reads no more than SRC's config.json: the method, --calib (the
    file, not yet its lines), --device, SRC itself, its family, the KV head count. ``attnlab convert`` runs them
    before it looks at DST (a missing SRC was reported as "destination exists"); returns SRC's config.json and
    family."""
    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}; got {method!r}")
    if calib is not None and method not in DATA_AWARE:
        raise ValueError(
            f"--calib is read only by --method {' / '.join(DATA_AWARE)}; --method {method} would ignore {calib}"
        )
    if method in DATA_AWARE and calib is None:
        raise ValueError(f"--method {method} needs --calib PATH (a text file of calibration lines)")
    conversion_device(device, method in DATA_AWARE, f"--method {method}")
    hf = io.read_config(src)
    io.copy_other_files(src, None)  # a broken link among the files to copy: refused before any work
    model_type = hf["model_type"]
    if model_type not in FAMILIES:  # the families convert takes, not every family attnlab reads
        raise ValueError(f"{src / 'config.json'}: model_type={model_type!r} is not supported; convert takes "
                         f"{_gqa_types()}")  # fmt: skip
    fam = family(model_type, f"{src / 'config.json'}")
    if fam.causal_lm and (fam.gqa is None or fam.tensors is None):
        raise ValueError(
            f"unsupported model_type {model_type!r}: its KV heads cannot be converted (supported: {_gqa_types()})"
        )
    attn = from_hf_config(src).attention
    check_kv_heads(attn.n_heads, attn.n_kv_heads, n_kv_heads)
    if calib is not None:
        check_calib(src, calib)
    return hf, fam


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    n_kv_heads: int,
    method: str = "mean",
    *,
    calib: str | Path | None = None,
    overwrite: bool = False,
    seed: int = 0,
    progress: Progress | None = None,
    device: str = "auto",
) -> dict:
    """Convert the checkpoint in ``src`` to ``n_kv_heads`` KV heads, written atomically to ``dst``.

    Returns a summary: architecture, heads before/after, KV cache values per token before/after, tensors
    rewritten and copied. ``progress(done, total)`` is called after each layer is converted. ``device``: where
    "fit" and "grouped-fit" run the model on the calibration text (``conversion_device``); tensors are written
    from the CPU.
    """
    src, dst = Path(src), Path(dst)
    hf, fam = check_inputs(src, n_kv_heads, method, calib, device)
    model_type = hf["model_type"]
    where = conversion_device(device, method in DATA_AWARE, f"--method {method}")
    # Checked again when writing; here so that a refused destination costs no loading.
    check_destination(dst, (src, calib), overwrite=overwrite)  # --calib is an input too
    model = bert.load_bert(src)[0] if not fam.causal_lm else load_causal_lm(src)
    attn = model.cfg.attention
    # again, on the loaded model: a BERT's GQA export keeps the MHA layout, so its config.json shows every head
    check_kv_heads(attn.n_heads, attn.n_kv_heads, n_kv_heads)
    io.check_finite(model, src)
    batches = (
        calibration_batches(src, calib, vocab_size=model.cfg.vocab_size, max_positions=model.cfg.max_seq_len)
        if calib is not None
        else None
    )
    merges = any(layer.attention.n_kv_heads != n_kv_heads for layer in model.layers)
    if batches and merges:
        tokens = sum(int(mask.sum()) for _, mask in batches)
        if tokens < attn.head_dim:  # the library says so too, after loading; here it can name the file
            raise ValueError(
                f"--calib {calib} gives {tokens} tokens; --method {method} needs at least head_dim="
                f"{attn.head_dim} (with fewer, each head's error weight is singular and the fit blows up)"
            )
    # conversions run in float32 (the fit in float64), a float64 source in float64; cast back on write
    wide = any(p.dtype == torch.float64 for p in model.parameters())
    model = (model.double() if wide else model.float()).to(where)
    if method in DATA_AWARE:  # the other methods run no model
        resources.announce_device(where)
    with computing_on(where):
        converted = convert_model(
            model,
            n_kv_heads,
            method,
            calib=on_device(batches or [], where) or None,
            seed=seed,
            progress=progress,
            share=True,  # one copy of the weights the conversion leaves as they are (the peak was ~8.7x SRC)
        )
    # the tensors the conversion changed, against the source in the conversion's dtype (an exact cast)
    source, state = model.state_dict(), converted.state_dict()
    moved = {
        k for k, v in state.items() if k not in source or not (v is source[k] or torch.equal(source[k], v))
    }
    n_layers = model.cfg.n_layers
    del model, source, state
    converted = converted.cpu()

    tensors, files = io.read_tensors(src)
    state, cfg_out, new_hf = converted.state_dict(), converted.cfg, hf
    if fam.gqa == "repeated":  # the family's class has no KV-head field: each KV head repeated for its group
        state = repeat_kv_heads(state, converted.cfg.attention)
        # the MHA shapes the tensor map writes (BERT's encoder config is not a ModelConfig: the source's is)
        cfg_out = (
            converted.cfg.map_attention(lambda a: a.replace(n_kv_heads=a.n_heads))
            if fam.causal_lm
            else from_hf_config(hf)
        )
    else:
        new_hf = fam.write(cfg_out, hf)
    # the layout of the config.json written beside the tensors: a fused tensor's may follow a field the writer
    # changed (ChatGLM's query_key_value is per head without multi_query_attention, [q; k; v] with it)
    tensor_map = fam.tensor_map(new_hf)
    # the checkpoint tensors made from a tensor the conversion changed, by the names the source gives them, made
    # from their sources alone (not a second copy of every weight)
    changed = {key for key in tensors if set(tensor_map.sources(key)) & moved}
    new = tensor_map.to_checkpoint({n: state[n] for key in changed for n in tensor_map.sources(key)}, cfg_out)
    rewritten = []
    for key, value in tensors.items():
        if key in changed:
            tensors[key] = new[tensor_map.bare(key)].to(value.dtype).contiguous()
            rewritten.append(key)
    weight_names = set(files.values()) | {io.INDEX, "config.json"}
    with io.atomic_dir(dst, overwrite, sources=(src, calib)) as tmp:
        io.write_tensors(tmp, tensors, files, like=src)
        io.write_config(tmp, new_hf)
        left_out = io.copy_other_files(src, tmp, skip=weight_names)
    head_dim = attn.head_dim
    return {
        "src": str(src),
        "dst": str(dst),
        "model_type": model_type,
        "method": method,
        "n_layers": n_layers,
        "n_heads": attn.n_heads,
        "n_kv_heads_before": attn.n_kv_heads,
        "n_kv_heads_after": n_kv_heads,
        "kv_values_per_token_before": 2 * n_layers * attn.n_kv_heads * head_dim,
        "kv_values_per_token_after": 2 * n_layers * n_kv_heads * head_dim,
        "layout": "gqa" if fam.gqa == "native" else "mha (repeated K/V heads)",
        "tensors_rewritten": len(rewritten),
        "tensors_copied": len(tensors) - len(rewritten),
        # a no-op conversion (the source's KV heads) runs no calibration
        "calibration_sequences": sum(len(ids) for ids, _ in batches) if batches and merges else 0,
        "device": str(where),
        # weight files of the source (other formats, other safetensors) that would contradict the new weights
        "files_left_out": left_out,
    }
