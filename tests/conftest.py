"""Shared fixtures: gloo process pools, the prepared Shakespeare corpus, a tiny token dataset."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.process_pool import ProcessPool

# every process group the tests start (here, in the pools, in the recipes and launchers they run)
# is gloo, also on a GPU host: NCCL would need one GPU per rank, which a 1-GPU machine lacks
os.environ.setdefault("MEGAZERO_DIST_BACKEND", "gloo")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS_PREFIX = os.path.join(REPO, "data", "gpt2", "shakespeare")


def write_token_dataset(prefix: str) -> str:
    """40 documents of a learnable sequence (next = 3 * prev + 1 mod 251, 10% noise), vocab 256."""
    from megazero.data import write_indexed_dataset

    rng = np.random.default_rng(0)
    docs = []
    for length in rng.integers(50, 400, size=40):
        doc = np.empty(int(length), dtype=np.uint16)
        doc[0] = rng.integers(0, 251)
        for i in range(1, len(doc)):
            doc[i] = rng.integers(0, 251) if rng.random() < 0.1 else (3 * int(doc[i - 1]) + 1) % 251
        docs.append(doc)
    write_indexed_dataset(prefix, docs, np.uint16)
    return prefix


@pytest.fixture(autouse=True)
def _rng_tracker_left_as_found():
    """The tensor-parallel RNG tracker is process-wide: a test that seeds it here (as
    model_parallel_seed does) would change the dropout masks every later test in this process
    draws, so each test leaves it as it found it (empty, unless a test seeded it on purpose)."""
    from megazero.tensor_parallel.random import get_rng_tracker

    saved = get_rng_tracker().get_states()
    yield
    get_rng_tracker().set_states(saved)


@pytest.fixture(scope="session")
def pools():
    """pools(n) -> a ProcessPool of n gloo ranks, started once per session and reused."""
    made: dict[int, ProcessPool] = {}

    def get(world_size: int) -> ProcessPool:
        if world_size not in made:
            made[world_size] = ProcessPool(world_size)
        return made[world_size]

    yield get
    for pool in made.values():
        pool.close()


@pytest.fixture(scope="session")
def corpus_prefix() -> str:
    """The real corpus, fetched and tokenized exactly as `make data` does (cached under data/)."""
    if not os.path.exists(CORPUS_PREFIX + "_train_text_document.idx"):
        subprocess.run(["make", "-C", REPO, "data", f"PYTHON={sys.executable}"], check=True)
    return CORPUS_PREFIX


@pytest.fixture()
def token_dataset_prefix(tmp_path) -> str:
    """write_token_dataset() in a fresh temporary directory."""
    return write_token_dataset(str(tmp_path / "tokens"))


@pytest.fixture(scope="module")
def token_dataset_prefix_module(tmp_path_factory) -> str:
    """token_dataset_prefix, shared by the tests of one module."""
    return write_token_dataset(str(tmp_path_factory.mktemp("tokens") / "tokens"))
