"""Attention modules and the attention math."""

from .gqa import GroupedQueryAttention
from .kernels import attend
from .mla import MultiHeadLatentAttention

__all__ = ["GroupedQueryAttention", "MultiHeadLatentAttention", "attend"]
