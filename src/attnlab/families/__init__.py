"""Model families: what attnlab knows of each kind of checkpoint, one module per family behind one registry.

``FAMILIES`` maps a config.json ``model_type`` to its ``Family`` (``base.py`` says what a family holds: the config
reader and writer, the tensor map with its named transforms, how fewer KV heads are written, what MLA conversion
makes of it). ``attnlab.hf_config``, ``attnlab.hf`` and the cost model ask this registry and nothing else; adding a
family is its module, its test file, and its entry in ``REGISTERED`` below (docs/architecture.md, "How to add ...
A model family"; tests/families/test_new_family.py defines one in a test and runs every command on it).
"""

from __future__ import annotations

from .base import Family, Fields, MLASupport, Rule, TensorMap, Transform
from .bert import BERT
from .chatglm import CHATGLM
from .deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from .gemma import GEMMA, GEMMA2, GEMMA3
from .glm import GLM, GLM4
from .gpt2 import GPT2
from .gpt_neox import GPT_NEOX
from .llama import LLAMA, MISTRAL, QWEN2
from .olmo2 import OLMO2
from .phi3 import PHI3
from .qwen3 import QWEN3

REGISTERED: tuple[Family, ...] = (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    GEMMA,
    GEMMA2,
    GEMMA3,
    PHI3,
    OLMO2,
    GPT_NEOX,
    GLM,
    GLM4,
    DEEPSEEK_V3,
    DEEPSEEK_V2,
    CHATGLM,
    GPT2,
    BERT,
)
FAMILIES: dict[str, Family] = {model_type: f for f in REGISTERED for model_type in f.model_types}


def family(model_type: object, where: str = "config.json") -> Family:
    """The family of ``model_type``; a ValueError naming the supported ones otherwise."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(
            f"{where}: model_type={model_type!r} is not supported; supported: {', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]


def causal_lm_types() -> tuple[str, ...]:
    """The model_types whose checkpoints load as ``attnlab.model.Transformer``."""
    return tuple(t for t, f in FAMILIES.items() if f.causal_lm and f.tensors is not None)


__all__ = [
    "FAMILIES",
    "REGISTERED",
    "Family",
    "Fields",
    "MLASupport",
    "Rule",
    "TensorMap",
    "Transform",
    "family",
]
