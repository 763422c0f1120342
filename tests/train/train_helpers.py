"""Helpers of the training tests (imported by conftest.py and the tests; fixtures live in conftest.py)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import transformers
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.data import shakespeare

SHAKESPEARE = shakespeare()  # the corpus the package ships
WORKS = ("hamlet", "macbeth", "othello")
VOCAB = 320
# The line a command that runs a model prints on stderr when it starts (``resources.announce_device``), here;
# uptrain adds its precision (and ranks).
CPU_LINE = re.compile(r"device: cpu \(.+, \d+ threads?\)(, .+)?")


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` by relative name: equal snapshots mean nothing was touched."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def run_cli(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


def make_llama(path: Path, tokenizer, **overrides) -> Path:
    """A random transformers Llama (or ``model_type`` given by ``kind``) saved with ``tokenizer``."""
    torch.manual_seed(0)
    kind = overrides.pop("kind", "llama")
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[kind]
    cfg = config_cls(
        **{
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "max_position_embeddings": 64,
            "eos_token_id": 0,
            "bos_token_id": 0,
        }
        | overrides
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    return path
