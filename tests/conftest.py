"""Shared test setup: Hugging Face stays offline, every test starts from a known torch seed, and the session fails
if a test read a file beside the checkout (``outside_reads``: the suite must pass in a plain clone).

Seed sweeps: ``ATTNLAB_SEEDS=N`` runs every test N times, with base seeds 0 .. N-1 (the default, 1, is seed 0
only). The autouse fixture seeds torch with the base seed, and tests that draw from their own generators offset
those generators' seeds by ``base_seed``, so a sweep changes every random input of the equivalence and conversion
suites. Claims that hold only for a lucky seed fail a sweep. Property tests draw fixed examples unless ``ATTNLAB_EXPLORE=1``.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

from outside_reads import READS, install

install()

# Property tests draw the same examples on every run, like the seeded tests: a verdict never depends on which
# examples a run happened to draw. ATTNLAB_EXPLORE=1 lets hypothesis search afresh (and keep what fails in
# .hypothesis/ to replay).
settings.register_profile("fixed", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile("explore" if os.environ.get("ATTNLAB_EXPLORE") == "1" else "fixed")

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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not READS:
        return
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
    lines = [f"{path}  (read by {test})" for path, test in READS.items()]
    report = session.config.pluginmanager.get_plugin("terminalreporter")
    if report is None:
        print("tests read files beside the checkout:", *lines, sep="\n")
        return
    report.write_line("")
    report.write_sep("=", "FAILED: tests read files beside the checkout (a plain clone lacks them)", red=True)
    for line in lines:
        report.write_line(line)
