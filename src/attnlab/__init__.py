"""attnlab: MHA, MQA, GQA and MLA attention that is right, fast and costed.

The public names load on first use (PEP 562), so that ``import attnlab`` and ``attnlab --help`` do not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig",
    "GroupedQueryAttention",
    "KVCache",
    "LatentCache",
    "MLAConfig",
    "ModelConfig",
    "MultiHeadLatentAttention",
    "PagedKVCache",
    "StaticKVCache",
    "attend",
]

if TYPE_CHECKING:
    from .attention import GroupedQueryAttention, MultiHeadLatentAttention, attend
    from .cache import KVCache, LatentCache, PagedKVCache, StaticKVCache
    from .config import AttentionConfig, MLAConfig, ModelConfig


def __getattr__(name: str) -> Any:
    if name in ("AttentionConfig", "MLAConfig", "ModelConfig"):
        from . import config as module
    elif name in ("KVCache", "LatentCache", "PagedKVCache", "StaticKVCache"):
        from . import cache as module
    elif name in ("GroupedQueryAttention", "MultiHeadLatentAttention", "attend"):
        from . import attention as module
    else:
        raise AttributeError(f"module 'attnlab' has no attribute {name!r}")
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
