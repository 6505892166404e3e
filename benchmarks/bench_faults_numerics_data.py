"""Fault trials for runaway numerics and bad data files (issue 14, items 5 and 6): how many injected
faults were survived (stopped cleanly, with the right message, weights untouched), how long from
the fault to the stop, and what was lost.

Numerics: the tiny GPT of tests/training_helpers.py on 1 process and 2 gloo ranks, fp32/bf16/fp16,
faults from tests/faults/test_numerics.py (nan written into one gradient, loss + inf, loss * nan),
first bad step drawn at random, max_consecutive_skipped_steps 3; and 2-rank torchrun jobs, timed
from the fault to the exit of every process. The guard before backward is timed against the old
expression. Data: the corpus of `make data`, copied, then truncated at random sizes or one byte of
its .idx overwritten at random; a 512 MB synthetic .bin for the token-id scan's speed.

    python benchmarks/bench_faults_numerics_data.py [--trials N]
Writes benchmarks/results/faults_numerics_data.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from benchmarks.record import write_result
from megazero.data import DatasetFormatError, IndexedDataset, check_token_ids, write_indexed_dataset
from megazero.numerics import loss_guard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if REPO not in sys.path:  # the trials reuse the test suite's helpers (tests/)
    sys.path.insert(0, REPO)
CORPUS = os.path.join(REPO, "data", "gpt2", "shakespeare")
LIMIT = 3


def numerics_trials(trials: int, prefix: str) -> list[dict]:
    """Every (world, precision, fault) `trials` times, first bad step drawn from 2..5."""
    from tests.faults.test_numerics import _run_kw
    from tests.process_pool import ProcessPool

    rng = random.Random(0)
    rows = []
    for world in (1, 2):
        pool = ProcessPool(world)
        try:
            for precision in ("fp32", "bf16", "fp16"):
                for kind in ("grad", "loss_inf", "loss_nan"):
                    times, survived = [], 0
                    for _ in range(trials):
                        first = rng.randint(2, 5)
                        results = pool.run(_run_kw, dict(prefix=prefix, precision=precision, kind=kind,
                                                         bad_steps=list(range(first, 30)), limit=LIMIT,
                                                         fault_ranks=(world - 1,), max_steps=30))
                        expected = f"step {first + LIMIT - 1}: {LIMIT} consecutive optimizer steps skipped"
                        ok = (all(r["stop"] == first + LIMIT - 1 and r["unchanged"] for r in results)
                              and len({r["error"] for r in results}) == 1 and expected in results[0]["error"])
                        survived += ok
                        times.append(max(r["elapsed"] for r in results))
                    rows.append({"fault": f"{kind} {precision}", "world": world, "trials": trials,
                                 "survived": survived, "fault_to_stop_s": statistics.mean(times),
                                 "lost": f"{LIMIT} skipped steps of compute; 0 applied steps, 0 bytes"})
                    print(rows[-1], flush=True)
        finally:
            pool.close()
    return rows


def _torchrun_worker(prefix: str, fault_file: str) -> None:
    """One rank of a torchrun job: fp32, nan gradients on rank 1 from step 3; rank 0 writes the time
    of the fault (the start of step 3) to `fault_file`."""
    import megazero
    from megazero.numerics import NumericsError
    from tests.training_helpers import base_config, build_engine

    megazero.init_distributed()
    engine, loader = build_engine(base_config(max_consecutive_skipped_steps=LIMIT), prefix)
    data = iter(loader)
    while True:
        if engine.global_steps + 1 == 3:
            if engine.global_rank == 0:
                with open(fault_file, "w") as f:
                    f.write(str(time.time()))
            if engine.global_rank == 1:
                next(engine.module.parameters()).register_hook(lambda g: torch.full_like(g, float("nan")))
        try:
            engine.train_batch(data)
        except NumericsError as e:
            print(f"rank {engine.global_rank}: NumericsError: {str(e)[:60]}", flush=True)
            raise


def torchrun_trials(trials: int, prefix: str) -> dict:
    """2-rank torchrun jobs: seconds from the fault to the exit of every process."""
    times, survived = [], 0
    fault_file = os.path.join(tempfile.mkdtemp(prefix="bench_torchrun_"), "fault_at")
    for _ in range(trials):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.abspath(__file__), "--worker", prefix, fault_file]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}, timeout=600)
        ended = time.time()  # torchrun returns once every worker has exited
        ok = proc.returncode != 0 and proc.stdout.count("NumericsError: step 5: 3 consecutive") == 2
        survived += ok
        if os.path.exists(fault_file):
            with open(fault_file) as f:
                times.append(ended - float(f.read()))
            os.remove(fault_file)
    return {"fault": "nan gradient fp32, torchrun job", "world": 2, "trials": trials, "survived": survived,
            "fault_to_stop_s": statistics.mean(times) if times else None,
            "lost": f"{LIMIT} skipped steps; every process exited non-zero"}


def guard_overhead(calls: int = 20000) -> dict:
    """Microseconds the check before backward adds per micro-batch (CPU, a scalar loss)."""
    w = torch.ones(8, requires_grad=True)

    def old():
        (w.sum() * 0.5).float().mul(1.0 / 2).backward()

    def new():
        loss = w.sum() * 0.5
        (loss.float() * (1.0 / 2) * loss_guard(loss)).backward()

    best = {}
    for name, fn in (("old", old), ("new", new), ("old2", old), ("new2", new)):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best[name[:3]] = min(best.get(name[:3], 1e9), (time.perf_counter() - start) / calls * 1e6)
    return {"backward_us_old": best["old"], "backward_us_new": best["new"], "added_us": best["new"] - best["old"]}


def _expect_error(prefix: str, vocab: int | None = None) -> tuple[bool, float]:
    start = time.perf_counter()
    try:
        indexed = IndexedDataset(prefix)
        if vocab is not None:
            check_token_ids(indexed, vocab)
    except DatasetFormatError as e:
        return os.path.basename(prefix) in str(e), time.perf_counter() - start
    return False, time.perf_counter() - start


def data_trials(trials: int) -> list[dict]:
    """Random truncations of the .bin and random one-byte overwrites of the .idx of the real corpus."""
    rng = random.Random(0)
    work = tempfile.mkdtemp(prefix="bench_faults_")
    prefix = os.path.join(work, "copy")
    rows = []
    try:
        def fresh():
            for ext in (".bin", ".idx"):
                shutil.copy(CORPUS + "_train_text_document" + ext, prefix + ext)

        size = os.path.getsize(CORPUS + "_train_text_document.bin")
        idx_size = os.path.getsize(CORPUS + "_train_text_document.idx")
        for name, corrupt in (
            ("truncated .bin (random size)", lambda: os.truncate(prefix + ".bin", rng.randrange(0, size))),
            ("one .idx byte overwritten (random)", lambda: _overwrite(prefix + ".idx", rng.randrange(idx_size), rng)),
        ):
            found, times = 0, []
            for _ in range(trials):
                fresh()
                corrupt()
                ok, seconds = _expect_error(prefix)
                found += ok
                times.append(seconds)
            rows.append({"fault": name, "world": 1, "trials": trials, "survived": found,
                         "fault_to_stop_s": statistics.mean(times), "lost": "0 steps (before training), 0 bytes"})
            print(rows[-1], flush=True)
        fresh()
        found, times = 0, []
        for _ in range(trials):
            ok, seconds = _expect_error(prefix, vocab=rng.randrange(100, 7900))
            found += ok
            times.append(seconds)
        rows.append({"fault": "tokenizer vocab below the data's ids (random size)", "world": 1, "trials": trials,
                     "survived": found, "fault_to_stop_s": statistics.mean(times),
                     "lost": "0 steps (before training), 0 bytes"})
        print(rows[-1], flush=True)
    finally:
        shutil.rmtree(work)
    return rows


def _overwrite(path: str, offset: int, rng: random.Random) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([(old + rng.randrange(1, 256)) % 256]))  # always a different byte


def scan_speed() -> dict:
    """MB/s of check_token_ids over a 512 MB uint16 .bin (page cache warm) and the real corpus."""
    work = tempfile.mkdtemp(prefix="bench_scan_")
    try:
        prefix = os.path.join(work, "big")
        rng = np.random.default_rng(0)
        write_indexed_dataset(prefix, [rng.integers(0, 50000, 1 << 20, dtype=np.uint16) for _ in range(256)],
                              np.uint16)
        out = {}
        for name, p in (("synthetic_512MB", prefix), ("corpus", CORPUS + "_train_text_document")):
            indexed = IndexedDataset(p)
            mb = os.path.getsize(p + ".bin") / 1e6
            best = min(_timed(check_token_ids, indexed, 65000) for _ in range(3))
            out[name] = {"MB": mb, "seconds": best, "MB_per_s": mb / best}
        return out
    finally:
        shutil.rmtree(work)


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5, help="per numerics fault (data faults: 10x)")
    parser.add_argument("--parts", default="guard,scan,data,numerics,torchrun",
                        help="comma-separated subset of guard,scan,data,numerics,torchrun")
    parser.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _torchrun_worker(*args.worker)
    from tests.conftest import write_token_dataset

    parts = set(args.parts.split(","))
    tokens = write_token_dataset(os.path.join(tempfile.mkdtemp(prefix="bench_tokens_"), "tokens"))
    result = {"guard": guard_overhead() if "guard" in parts else None,
              "scan": scan_speed() if "scan" in parts else None}
    print(result, flush=True)
    rows = data_trials(args.trials * 10) if "data" in parts else []
    rows += numerics_trials(args.trials, tokens) if "numerics" in parts else []
    if "torchrun" in parts:
        rows.append(torchrun_trials(max(1, args.trials // 2), tokens))
    result["rows"] = rows
    write_result("faults_numerics_data", result, args=args)
    print("| fault | ranks | trials | survived | fault to stop (s) | lost |\n|---|---|---|---|---|---|")
    for r in rows:
        seconds = f"{r['fault_to_stop_s']:.3g}" if r["fault_to_stop_s"] is not None else "-"
        print(f"| {r['fault']} | {r['world']} | {r['trials']} | {r['survived']} | {seconds} | {r['lost']} |")


if __name__ == "__main__":
    main()
