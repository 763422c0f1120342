"""Hugging Face checkpoints of every registered family (``attnlab.families``): causal LMs <-> ``attnlab.model``
(``load_causal_lm`` / ``save_causal_lm`` / ``save_model``), BERT <-> ``BertEncoder``, and on-disk conversion to fewer
KV heads or to a native DeepSeek-V3 MLA checkpoint (safetensors only, written atomically, source untouched)."""

from .bert import BertEncoder, EncoderConfig, export_bert_mha, load_bert, sentence_embeddings
from .causal_lm import load_causal_lm, save_causal_lm, save_model
from .checkpoint import convert_checkpoint
from .deepseek import load_deepseek, save_deepseek
from .llama import load_llama, model_config_from_hf, save_llama
from .mla_checkpoint import convert_checkpoint_to_mla

__all__ = [
    "BertEncoder",
    "EncoderConfig",
    "convert_checkpoint",
    "convert_checkpoint_to_mla",
    "export_bert_mha",
    "load_bert",
    "load_causal_lm",
    "load_deepseek",
    "load_llama",
    "model_config_from_hf",
    "save_causal_lm",
    "save_deepseek",
    "save_llama",
    "save_model",
    "sentence_embeddings",
]
