"""Hugging Face checkpoints: Llama / Mistral / Qwen2 <-> ``attnlab.model``, BERT <-> ``BertEncoder``, and
on-disk conversion to fewer KV heads (safetensors only, written atomically, source untouched)."""

from .bert import BertEncoder, EncoderConfig, export_bert_mha, load_bert, sentence_embeddings
from .checkpoint import convert_checkpoint
from .llama import load_llama, model_config_from_hf, save_llama

__all__ = [
    "BertEncoder",
    "EncoderConfig",
    "convert_checkpoint",
    "export_bert_mha",
    "load_bert",
    "load_llama",
    "model_config_from_hf",
    "save_llama",
    "sentence_embeddings",
]
