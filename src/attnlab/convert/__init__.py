"""Checkpoint conversion on attnlab modules: MHA -> GQA/MQA (``mha_to_gqa``, ``convert_model``) and
GQA/MHA -> MLA in DeepSeek's layout (``gqa_to_mla``, ``convert_model_to_mla``, ``fold_latent_norms``)."""

from .gqa import METHODS, mha_to_gqa, permute_heads
from .latent_norm import fold_latent_norm
from .mla import gqa_to_mla
from .mla_model import (
    PLANES,
    choose_stride,
    convert_model_to_mla,
    fold_latent_norms,
    layer_errors,
    logit_distance,
    logit_distances,
)
from .model import attention_inputs, convert_model

__all__ = [
    "METHODS",
    "PLANES",
    "attention_inputs",
    "choose_stride",
    "convert_model",
    "convert_model_to_mla",
    "fold_latent_norm",
    "fold_latent_norms",
    "gqa_to_mla",
    "layer_errors",
    "logit_distance",
    "logit_distances",
    "mha_to_gqa",
    "permute_heads",
]
