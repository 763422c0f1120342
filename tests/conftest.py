"""Shared test setup: Hugging Face stays offline, and every test starts from the same torch seed."""

from __future__ import annotations

import os

import pytest
import torch

# Nothing may download at test time (transformers is imported only by the tests that compare against it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Run a test on one intra-op thread: the tensors in equivalence tests are tiny, and on a shared 2-core
    machine a second spinning thread makes them ~10x slower. Restores the previous setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
