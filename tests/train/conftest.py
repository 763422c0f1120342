"""Tiny real checkpoints for the training tests, built offline: a random-weight transformers Llama with a
byte-level BPE tokenizer trained by ``tokenizers`` on a little Shakespeare."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_helpers import SHAKESPEARE, VOCAB, WORKS, make_llama

from attnlab.data import train_byte_bpe


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """Three files (the first 12,000 characters of three plays): two train, one is held out."""
    root = tmp_path_factory.mktemp("corpus")
    for name in WORKS:
        (root / f"{name}.txt").write_text((SHAKESPEARE / f"{name}.txt").read_text()[:12000])
    return root


@pytest.fixture(scope="session")
def tokenizer(corpus):
    return train_byte_bpe([p.read_text() for p in sorted(corpus.glob("*.txt"))], VOCAB)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer) -> Path:
    """Never modified by a test (several check its hash)."""
    return make_llama(tmp_path_factory.mktemp("ckpt") / "src", tokenizer)


@pytest.fixture(autouse=True)
def _tiny_models_run_on_one_thread(one_thread):
    """Every training test: see ``one_thread`` in tests/conftest.py."""
