"""Checkpoint conversion on attnlab modules: MHA -> GQA/MQA (``mha_to_gqa``, ``convert_model``), GQA -> MLA."""

from .gqa import METHODS, mha_to_gqa, permute_heads
from .mla import gqa_to_mla
from .model import attention_inputs, convert_model

__all__ = ["METHODS", "attention_inputs", "convert_model", "gqa_to_mla", "mha_to_gqa", "permute_heads"]
