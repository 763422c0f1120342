"""attnlab: MHA, MQA, GQA and MLA attention that is right, fast and costed."""

from .attention import GroupedQueryAttention, MultiHeadLatentAttention, attend
from .cache import KVCache, LatentCache, PagedKVCache
from .config import AttentionConfig, MLAConfig, ModelConfig

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
    "attend",
]
