"""Shared test setup: Hugging Face stays offline, and every test starts from a known torch seed.

Seed sweeps: ``ATTNLAB_SEEDS=N`` runs every test N times, with base seeds 0 .. N-1 (the default, 1, is seed 0
only). The autouse fixture seeds torch with the base seed, and tests that draw from their own generators offset
those generators' seeds by ``base_seed``, so a sweep changes every random input of the equivalence and conversion
suites. Claims that hold only for a lucky seed fail a sweep.
"""

from __future__ import annotations

import os

import pytest
import torch

# Nothing may download at test time (transformers is imported only by the tests that compare against it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SEEDS = int(os.environ.get("ATTNLAB_SEEDS", "1"))
_base = [0]  # the running test's base seed


def seeded(seed: int | str) -> int | str:
    """A test's own seed moved by the running base seed (unchanged at base seed 0)."""
    if isinstance(seed, str):
        return seed if _base[0] == 0 else f"{seed}-{_base[0]}"
    return seed + _base[0]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if SEEDS > 1 and "base_seed" in metafunc.fixturenames:
        metafunc.parametrize("base_seed", range(SEEDS), indirect=True, ids=lambda s: f"seed{s}")


@pytest.fixture
def base_seed(request: pytest.FixtureRequest) -> int:
    return getattr(request, "param", 0)


@pytest.fixture(autouse=True)
def _seed(base_seed: int) -> None:
    _base[0] = base_seed
    torch.manual_seed(base_seed)


@pytest.fixture
def one_thread():
    """Run a test on one intra-op thread: the tensors in equivalence tests are tiny, and on a shared 2-core
    machine a second spinning thread makes them ~10x slower. Restores the previous setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
