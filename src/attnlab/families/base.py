"""What a model family is: a config reader and writer, a tensor map with named transforms, and what conversions need.

A family module (``llama.py``, ``gemma.py``, ...) defines one or more ``Family`` objects; ``families/__init__.py``
collects them into the registry ``FAMILIES`` (model_type -> Family). Everything else asks the registry:

- ``read(fields)``: config.json (through ``Fields``, typed access whose errors name the field) -> ``ModelConfig``.
  A field attnlab does not model (an unknown ``rope_type``, a LayerNorm ChatGLM, ...) is a ValueError naming it:
  never a silently different model.
- ``write(cfg, base)``: ``ModelConfig`` -> the config.json of a checkpoint like ``base`` (the source's), with the
  fields that changed (KV heads, ...) and nothing stale. None: the family is read, never written.
- ``tensors``: a ``TensorMap`` between the checkpoint's tensor names and attnlab's state-dict names. A rule renames
  one tensor, or splits one into several (and merges them back) with a named ``Transform`` (fused QKV of each
  layout, fused gate/up, RoPE pair permutations), each exact both ways and tested as a round trip.
- ``gqa``: how a checkpoint with fewer KV heads is written: "native" (the family's own ``num_key_value_heads``
  field or its like), "repeated" (its class has no such field: the MHA layout with each KV head repeated for its
  group, which computes the GQA model exactly), or None (refused).
- ``mla``: ``MLASupport``: whether ``convert --to mla`` takes the family and why (exact, approximate, refused).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import LAYER_TYPES, ROPE_NEEDS, AttentionConfig, ModelConfig, rope_parameter_problem

_MISSING = object()
# No model has a size field past this (2**31: 8x the largest vocabulary or context in use); beyond it a value is a
# typo, and products of such values would overflow the floats of the roofline.
MAX_FIELD = 2**31
# Nor a layer count past this (the deepest published models have about 130): a million layers hung every command,
# which builds or costs the model layer by layer before it can see that the weights hold two.
MAX_LAYERS = 4096


class Fields:
    """Typed access to a config.json dict; every error names the field."""

    def __init__(self, raw: dict[str, Any], model_type: str, where: str | None = None) -> None:
        self.raw, self.model_type = raw, model_type
        # what the errors name: the file where there is one ("llama config.json" named no checkpoint)
        self.label = where or f"{model_type} config.json"

    def within(self, raw: dict[str, Any]) -> Fields:
        """Fields of ``raw``, a part of this config or one derived from it (``rope_parameters``, the config with a
        default filled in), whose errors name the same file."""
        return Fields(raw, self.model_type, self.label)

    def _get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key, default)
        if value is _MISSING:
            raise ValueError(f"{self.label}: missing field {key!r}")
        return value

    def layers(self, key: str) -> int:
        """A layer count: ``int`` up to ``MAX_LAYERS``."""
        return self.int(key, maximum=MAX_LAYERS)

    def int(
        self,
        key: str,
        default: Any = _MISSING,
        *,
        minimum: int = 1,
        null: Any = _MISSING,
        maximum: int = MAX_FIELD,
    ) -> int:
        """``null``: the value of a field present as null, where transformers' config class reads null so
        (num_key_value_heads: null is MHA), and absence as ``default``."""
        value = self._get(key, default)
        if value is None and null is not _MISSING:
            value = null
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{self.label}: field {key!r} must be an int, got {value!r}")
        if not minimum <= value <= maximum:
            raise ValueError(f"{self.label}: field {key!r} must be in [{minimum}, {maximum}], got {value}")
        return value

    def opt_int(self, key: str, *, minimum: int = 1) -> int | None:
        return None if self.raw.get(key) is None else self.int(key, minimum=minimum)

    def float(self, key: str, default: Any = _MISSING, *, above: float | None = None) -> float:
        """A finite number (greater than ``above`` where given)."""
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{self.label}: field {key!r} must be a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an int past the float range
            number = math.inf
        if not math.isfinite(number):
            raise ValueError(f"{self.label}: field {key!r} must be finite, got {value!r}")
        if above is not None and not number > above:
            raise ValueError(f"{self.label}: field {key!r} must be > {above:g}, got {value!r}")
        return number

    def eps(self, key: str, default: float) -> float:
        """A norm's epsilon: a finite number >= 0."""
        number = self.float(key, default)
        if number < 0:
            raise ValueError(f"{self.label}: field {key!r} must be >= 0, got {number!r}")
        return number

    def opt_float(self, key: str) -> float | None:
        return None if self.raw.get(key) is None else self.float(key)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"{self.label}: field {key!r} must be true or false, got {value!r}")
        return value

    def str(self, key: str, default: Any = _MISSING, choices: tuple[str, ...] | None = None) -> str:
        value = self._get(key, default)
        if not isinstance(value, str) or (choices is not None and value not in choices):
            allowed = f"one of {', '.join(map(repr, choices))}" if choices else "a string"
            raise ValueError(f"{self.label}: field {key!r} must be {allowed}, got {value!r}")
        return value

    def fail(self, message: str) -> None:
        raise ValueError(f"{self.label}: {message}")

    def unsupported(self, key: str, why: str) -> None:
        """A field attnlab does not model: refused, naming it, rather than read as a different model."""
        raise ValueError(f"{self.label}: {key}={self.raw.get(key)!r} is not supported ({why})")

    def rope(self, default_theta: float = 10000.0) -> tuple[float, tuple[tuple[str, Any], ...]]:
        """(rope_theta, rope_scaling) for ``AttentionConfig``, read with transformers' precedence
        (``rope_parameters``): plain RoPE has no scaling; any other type keeps its parameters (and the model's
        ``max_position_embeddings``, which yarn and longrope read) for transformers' ROPE_INIT_FUNCTIONS."""
        params = rope_parameters(self.raw, self.model_type, default_theta)
        theta = self.within(params).float("rope_theta", above=0)
        kind = params.get("rope_type", "default")
        if kind == "default":
            return theta, ()
        known = tuple(ROPE_NEEDS)
        if kind not in known:
            self.fail(
                f"rope_type={kind!r} is not supported (attnlab computes {', '.join(('default', *known))})"
            )
        if (
            kind in ("llama3", "yarn", "longrope")
            and self.raw.get("original_max_position_embeddings") is not None
        ):
            # a top-level value wins over one inside the parameters (transformers 5's standardize_rope_params): it
            # was read from inside them alone, and every position past the first differed from transformers'
            params = params | {
                "original_max_position_embeddings": self.int("original_max_position_embeddings")
            }
        # what transformers' ROPE_INIT_FUNCTIONS read without a default (JSON: longrope's factors are lists)
        problem = rope_parameter_problem(kind, params, list)
        if problem:
            self.fail(f"{'rope_scaling' if self.raw.get('rope_scaling') else 'rope_parameters'}: {problem}")
        # partial_rotary_factor is the attention config's rope_dim; the scaling is computed over the rotary dims
        scaling = {
            k: v for k, v in params.items() if k not in ("rope_theta", "type", "partial_rotary_factor")
        }
        scaling["max_position_embeddings"] = self.raw.get("max_position_embeddings")
        return theta, freeze(scaling)


def freeze(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A parameters dict as sorted (key, value) pairs with lists as tuples: hashable, for ``AttentionConfig``."""
    return tuple(
        sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items() if v is not None)
    )


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


def check_heads(f: Fields, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int | None, kv_key: str,
                head_dim_key: str = "head_dim") -> None:  # fmt: skip
    """The head counts of a config.json agree with each other (errors name the fields)."""
    if n_heads % n_kv_heads:
        f.fail(f"{kv_key}={n_kv_heads} does not divide num_attention_heads={n_heads}")
    if head_dim is None and d_model % n_heads:
        f.fail(
            f"hidden_size={d_model} is not divisible by num_attention_heads={n_heads} and {head_dim_key} is not given"
        )


def check_layer_types(f: Fields, types: Any, n_layers: int) -> list[str]:
    """A config.json's ``layer_types``: one of transformers' ``full_attention`` / ``sliding_attention`` per layer
    (attnlab models no other kind: Llama 4's ``chunked_attention``, ... are refused naming the field)."""
    if not isinstance(types, list) or len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        f.fail(
            f"layer_types must list num_hidden_layers={n_layers} of {', '.join(LAYER_TYPES)}, got {types!r}"
        )
    return types


# ---- tensors -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transform:
    """A named, exact split of one checkpoint tensor into attnlab tensors, and the merge back. Both take the
    model's config (head counts and sizes)."""

    name: str
    split: Callable[[torch.Tensor, ModelConfig], list[torch.Tensor]]
    merge: Callable[[list[torch.Tensor], ModelConfig], torch.Tensor]


def _qkv_sizes(cfg: ModelConfig) -> list[int]:
    attn = cfg.attention
    return [attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim]


# Q, K and V stacked along the output rows: [q; k; v] (Phi-3 qkv_proj, ChatGLM query_key_value). Weights and biases.
QKV_CONCAT = Transform(
    "qkv_concat",
    split=lambda t, cfg: list(torch.split(t, _qkv_sizes(cfg), dim=0)),
    merge=lambda parts, cfg: torch.cat(parts, dim=0),
)


def _per_head_split(t: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    attn = cfg.attention
    if attn.n_kv_heads != attn.n_heads:
        raise ValueError("the per-head QKV layout has as many KV heads as query heads")
    heads = t.reshape(attn.n_heads, 3, attn.head_dim, *t.shape[1:])
    return [heads[:, i].reshape(attn.n_heads * attn.head_dim, *t.shape[1:]) for i in range(3)]


def _per_head_merge(parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    attn = cfg.attention
    heads = [p.reshape(attn.n_heads, 1, attn.head_dim, *p.shape[1:]) for p in parts]
    return torch.cat(heads, dim=1).reshape(3 * attn.n_heads * attn.head_dim, *parts[0].shape[1:])


# Q, K and V interleaved head by head: [q_0; k_0; v_0; q_1; ...] (GPT-NeoX query_key_value). MHA only.
QKV_PER_HEAD = Transform("qkv_per_head", split=_per_head_split, merge=_per_head_merge)

# Gate and up projections stacked along the output rows: [gate; up] (Phi-3 and GLM gate_up_proj, ChatGLM
# dense_h_to_4h; the first half goes through the activation).
GATE_UP_CONCAT = Transform(
    "gate_up_concat",
    split=lambda t, cfg: list(torch.chunk(t, 2, dim=0)),
    merge=lambda parts, cfg: torch.cat(parts, dim=0),
)


@dataclass(frozen=True)
class Rule:
    """Checkpoint tensor ``theirs`` <-> attnlab tensors ``ours``. Templates: ``{i}`` a layer index, ``{p}`` the
    parameter ("weight" or "bias"). One name: a rename, or with a ``transform`` a permutation (of RoPE rows);
    several: ``transform`` splits and merges."""

    theirs: str
    ours: tuple[str, ...]
    transform: Transform | None = None

    def __post_init__(self) -> None:
        if len(self.ours) > 1 and self.transform is None:
            raise ValueError(
                f"rule {self.theirs}: several attnlab tensors need a transform to split and merge"
            )


def _pattern(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{i\}|\{p\})", template)
    regex = "".join(
        {"{i}": r"(?P<i>\d+)", "{p}": r"(?P<p>weight|bias)"}.get(part, re.escape(part)) for part in parts
    )
    return re.compile(regex)


@dataclass(frozen=True)
class TensorMap:
    """The checkpoint's tensors <-> attnlab's state dict, by ``rules``. ``ignored``: regexes of checkpoint tensors
    that attnlab's model does not hold (buffers such as ``rotary_emb.inv_freq``, recomputed; BERT's pooler): skipped
    on load, copied as they are on conversion. ``prefix``: one that some checkpoints of the family put before every
    name (transformers' ``base_model_prefix``, as "bert." in a BertFor... checkpoint): names are read with or
    without it (``bare``) and written without it. ``family``: how errors name the checkpoint."""

    rules: tuple[Rule, ...]
    family: str
    ignored: tuple[str, ...] = (r"(^|\.)rotary_emb\.inv_freq$",)
    prefix: str = ""
    _compiled: list = field(default_factory=list, init=False, repr=False, compare=False)

    def _rules(self) -> list[tuple[Rule, re.Pattern[str], re.Pattern[str]]]:
        if not self._compiled:
            self._compiled.extend((r, _pattern(r.theirs), _pattern(r.ours[0])) for r in self.rules)
        return self._compiled

    def bare(self, key: str) -> str:
        """A checkpoint tensor's name without the family's ``prefix``: the name the rules read."""
        return key.removeprefix(self.prefix) if self.prefix else key

    def is_ignored(self, key: str) -> bool:
        return any(re.search(p, self.bare(key)) for p in self.ignored)

    def to_attnlab(self, tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """attnlab state dict of checkpoint ``tensors`` (the loaders check its key set against the model); a tied
        LM head is filled in from the token embeddings."""
        state: dict[str, torch.Tensor] = {}
        for key, value in tensors.items():
            if self.is_ignored(key):
                continue
            for rule, theirs, _ in self._rules():
                m = theirs.fullmatch(self.bare(key))
                if m is None:
                    continue
                names = [name.format(**m.groupdict()) for name in rule.ours]
                # a fused tensor of another shape: torch's reshape or split error was a traceback naming no tensor
                try:
                    parts = [value] if rule.transform is None else rule.transform.split(value, cfg)
                except (RuntimeError, ValueError, IndexError) as err:
                    raise ValueError(
                        f"tensor {key!r} of shape {tuple(value.shape)} does not hold what config.json says its "
                        f"{', '.join(names)} are ({' '.join(str(err).split())[:160]})"
                    ) from None
                state.update(zip(names, parts, strict=True))
                break
            else:
                raise ValueError(f"unexpected tensor {key!r} in a {self.family} checkpoint")
        if cfg.tie_embeddings and "tok_embeddings.weight" in state:
            state.setdefault("output.weight", state["tok_embeddings.weight"])
        return state

    def theirs(self, name: str) -> str:
        """The checkpoint tensor that holds attnlab's tensor ``name`` (a fused one for a part of it), for errors
        that name what the user can find in the weight files; ``name`` itself where no rule writes it."""
        for rule in self.rules:
            for template in rule.ours:
                m = _pattern(template).fullmatch(name)
                if m is not None:
                    return rule.theirs.format(**m.groupdict())
        return name

    def to_checkpoint(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """Checkpoint tensors of an attnlab state dict of config ``cfg`` (``lm_head`` left out when tied)."""
        out: dict[str, torch.Tensor] = {}
        used: set[str] = set()
        for rule, _, ours in self._rules():
            for name in state:
                m = ours.fullmatch(name)
                if m is None:
                    continue
                groups = m.groupdict()
                names = [template.format(**groups) for template in rule.ours]
                missing = [n for n in names if n not in state]
                if missing:
                    raise ValueError(f"{rule.theirs}: the state dict lacks {missing}")
                parts = [state[n].detach() for n in names]
                merged = parts[0] if rule.transform is None else rule.transform.merge(parts, cfg)
                out[rule.theirs.format(**groups)] = merged.clone()
                used.update(names)
        if cfg.tie_embeddings:
            used.add("output.weight")
            out = {k: v for k, v in out.items() if not _is_head(self, k)}
        unmapped = sorted(set(state) - used)
        if unmapped:
            raise ValueError(f"no {self.family} checkpoint name for {unmapped[:4]}")
        return out

    def sources(self, key: str) -> tuple[str, ...]:
        """The attnlab tensors that checkpoint tensor ``key`` is made from (none for an ignored buffer)."""
        for rule, theirs, _ in self._rules():
            m = theirs.fullmatch(self.bare(key))
            if m is not None:
                return tuple(name.format(**m.groupdict()) for name in rule.ours)
        return ()


def _is_head(tensor_map: TensorMap, key: str) -> bool:
    return tensor_map.sources(key) == ("output.weight",)


# ---- families ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MLASupport:
    """How ``attnlab convert --to mla`` treats a family: "exact"/"approximate" (the summary and docs say which, and
    ``note`` why), or "refused" (exit 2 with ``note``: what makes it impossible)."""

    verdict: str
    note: str

    def __post_init__(self) -> None:
        if self.verdict not in ("exact", "approximate", "refused"):
            raise ValueError(
                f"MLASupport.verdict must be exact, approximate or refused; got {self.verdict!r}"
            )


NO_MLA = MLASupport("refused", "no MLA conversion is defined for this family")


def rotary_layout_note(attn: AttentionConfig) -> str:
    """What ``convert --to mla`` does with a rotary layout other than Llama's (partial, interleaved), for a
    family's MLA note; "" for full rotary in half-split pairs. Both are exact (``convert.mla.head_rows``)."""
    parts = []
    if attn.rope and attn.rotary_dim < attn.head_dim:
        parts.append(
            f"the {attn.head_dim - attn.rotary_dim} of {attn.head_dim} head dims RoPE never turns go to "
            "DeepSeek's no-RoPE part (qk_nope_head_dim) as they are"
        )
    if attn.rope and attn.rope_interleaved:
        parts.append("the interleaved pairs (2i, 2i + 1) are reordered into DeepSeek's rotary layout")
    return f"{' and '.join(parts)}, exactly" if parts else ""


@dataclass(frozen=True)
class Family:
    """One kind of checkpoint (see the module docstring). ``architectures``: model_type -> transformers class."""

    name: str
    model_types: tuple[str, ...]
    read: Callable[[Fields], ModelConfig]
    write: Callable[[ModelConfig, dict], dict] | None = None
    # The tensor map, or a function of the checkpoint's config.json giving it (a layout flag in the config).
    tensors: TensorMap | Callable[[dict], TensorMap] | None = None
    architectures: dict[str, str] = field(default_factory=dict)
    gqa: str | None = "native"
    mla: Callable[[ModelConfig], MLASupport] = lambda cfg: NO_MLA
    causal_lm: bool = True  # loads as attnlab.model.Transformer (False: BERT's encoder)
    # Refusals that matter only when weights are loaded (what the cost model can read but attnlab.model cannot run
    # exactly), as ValueErrors naming the field.
    check_load: Callable[[Fields], None] | None = None
    # The checkpoints this family reads, in words (docs/families.md), and the config.json of a small model of the
    # family with its characteristic options: what ``attnlab families`` judges each capability on, and what
    # tests/families/test_support.py runs every command of the table on.
    covers: str = ""
    example: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.gqa not in ("native", "repeated", None):
            raise ValueError(f"Family.gqa must be native, repeated or None; got {self.gqa!r}")

    def config(self, fields: Fields, *, loading: bool = False) -> ModelConfig:
        """``read`` (after ``check_load`` when ``loading`` weights), whose errors name the file as ``Fields``' do:
        the config classes' own checks (an odd head_dim under RoPE, an odd MLA rotary dim) name their field alone."""
        try:
            if loading and self.check_load is not None:
                self.check_load(fields)
            return self.read(fields)
        except ValueError as err:
            if fields.label in str(err):
                raise
            raise ValueError(f"{fields.label}: {err}") from None

    def tensor_map(self, hf: dict) -> TensorMap:
        """The tensor map of a checkpoint whose config.json is ``hf``."""
        if self.tensors is None:
            raise ValueError(
                f"{self.name} checkpoints are read for the cost model only; their weights are not loaded"
            )
        return self.tensors(hf) if callable(self.tensors) else self.tensors


def attention_fields(attn: AttentionConfig) -> dict[str, Any]:
    """The config.json fields most families share for an attention config (Llama's names)."""
    return dict(
        hidden_size=attn.d_model,
        num_attention_heads=attn.n_heads,
        num_key_value_heads=attn.n_kv_heads,
        head_dim=attn.head_dim,
    )


def put(hf: dict[str, Any], key: str, value: Any, default: Any = None) -> None:
    """Set ``hf[key] = value`` unless the config already says that (``default``: what a missing key means), so a
    written config.json differs from its source in the fields that changed and no others."""
    if hf.get(key, default) != value:
        hf[key] = value


def rope_fields(
    hf: dict[str, Any], attn: AttentionConfig, model_type: str, default_theta: float = 10000.0
) -> None:
    """Write ``attn``'s RoPE into config.json ``hf`` as ``rope_parameters`` (and drop the older ``rope_scaling`` and
    top-level ``rope_theta``), unless ``hf`` already reads as that RoPE."""
    f = Fields(hf, model_type)
    if f.rope(default_theta) == (attn.rope_theta, attn.rope_scaling):
        return
    params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in attn.rope_scaling}
    params.pop("max_position_embeddings", None)
    hf.pop("rope_scaling", None)
    hf.pop("rope_theta", None)
    hf["rope_parameters"] = {"rope_type": "default"} | params | {"rope_theta": attn.rope_theta}


def sliding_layer_types(cfg: ModelConfig) -> list[str]:
    """Every layer's type, as transformers' ``layer_types`` lists them."""
    return [
        "sliding_attention" if getattr(attn, "window", None) is not None else "full_attention"
        for attn in cfg.layer_attentions
    ]


def mlp_obstacle(cfg: ModelConfig) -> str | None:
    """Why the MLPs of ``cfg`` cannot be written as a dense DeepSeek-V3's (None if they can): what an MLA conversion
    keeps as it is must be SwiGLU without bias."""
    if cfg.mlp != "swiglu" or cfg.mlp_bias or cfg.is_moe:
        return (
            f"DeepSeek-V3's dense MLP is SwiGLU without bias; got mlp={cfg.mlp!r}, mlp_bias={cfg.mlp_bias}, "
            f"n_experts={cfg.n_experts}"
        )
    return None
