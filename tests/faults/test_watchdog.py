"""Hung ranks are found and named (megazero.watchdog), with the faults injected for real:

- SIGSTOP rank 1 of a 2-rank recipe run (scripts/pretrain_gpt2.sh: torchrun, the recipe's config,
  the real corpus): every process must be gone within the timeout + 30 s, the output naming rank 1;
- SIGSTOP rank 0 of a run launched as srun launches it (one process per rank, rank 0 hosting the
  rendezvous store): rank 1 names the store's host and exits;
- two ranks deadlocked on receives whose wait returned early, as NCCL's does: the job exits,
  saying every rank waits;
- a healthy run whose checkpoint save (a stalled fsync) and evaluation each stall one rank for
  twice the timeout: it finishes, and the watchdog says nothing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from megazero.config import ConfigError, parse_config
from megazero.watchdog import EXIT_CODE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 10  # seconds: short, so that the tests are; the recipes' configs use 60
TINY = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--global-batch-size", "16", "--micro-batch-size", "4", "--peak-flops", "1e11", "--sample-tokens", "4")


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _workers(parent: int) -> dict[int, int]:
    """{RANK: pid} of the children of `parent` (torchrun's workers)."""
    workers = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == parent and b"RANK" in env:
            workers[int(env[b"RANK"])] = int(name)
    return workers


def _wait_for(path, pattern: str, procs, limit: float = 300.0) -> None:
    """Until `pattern` shows in the file at `path`; fails if a process in `procs` ends first."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if re.search(pattern, path.read_text(errors="replace")):
            return
        ended = [p for p in procs if p.poll() is not None]
        assert not ended, f"exited ({ended[0].returncode}) before {pattern!r}:\n{path.read_text()[-4000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within {limit} s:\n{path.read_text()[-4000:]}")


def _end(procs, pids=()) -> None:
    """SIGKILL what this test started and is still running (by pid), and reap it."""
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sigstop_trial(corpus_prefix: str, tmp_path, rank: int = 1, delay: float = 0.0,
                  extra: tuple[str, ...] = ()) -> tuple[float, str, int]:
    """Run the GPT recipe as `make pretrain-gpt2` does on 2 processes (more recipe flags in `extra`),
    SIGSTOP `rank` `delay` s after the first logged iteration; (seconds from the SIGSTOP until every
    process is gone, output, exit code)."""
    log = tmp_path / "out.txt"
    env = {**os.environ, "NPROC": "2", "PYTHON": sys.executable, "SAVE_DIR": str(tmp_path / "ckpt"),
           "TB_DIR": str(tmp_path / "tb"), "OMP_NUM_THREADS": "1"}
    cmd = ["bash", os.path.join(REPO, "scripts", "pretrain_gpt2.sh"), "--data-path", corpus_prefix, *TINY,
           "--train-iters", "100000", "--log-interval", "5", "--eval-interval", "40", "--eval-iters", "2",
           "--save-interval", "50", "--watchdog-timeout", str(TIMEOUT), *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    workers = {}
    try:
        _wait_for(log, r" iteration +\d+/", [proc])
        time.sleep(delay)
        workers = _workers(proc.pid)  # the script execs torchrun: its children are the ranks
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[rank], signal.SIGSTOP)
        stopped = time.monotonic()
        deadline = stopped + TIMEOUT + 90
        while (proc.poll() is None or any(_alive(pid) for pid in workers.values())) and time.monotonic() < deadline:
            time.sleep(0.05)
        gone = time.monotonic() - stopped
    finally:
        _end([proc], workers.values())
    return gone, log.read_text(errors="replace"), proc.returncode


@pytest.mark.slow
def test_sigstopped_rank_is_named_and_every_process_is_gone_within_the_timeout(corpus_prefix, tmp_path):
    gone, out, code = sigstop_trial(corpus_prefix, tmp_path, rank=1)
    assert code != 0, out[-4000:]
    assert gone <= TIMEOUT + 30, f"processes still there {gone:.1f} s after the SIGSTOP:\n{out[-4000:]}"
    assert re.search(r"\[megazero watchdog\] rank 0: .+ has waited [\d.]+ s \(timeout 10 s\)", out), out[-4000:]
    assert re.search(r"\[megazero watchdog\] rank 0: not arrived: rank 1 \(no heartbeat for [\d.]+ s: stopped",
                     out), out[-4000:]
    assert f"exiting with code {EXIT_CODE}" in out


@pytest.mark.slow
def test_sigstopped_store_host_is_named_under_an_srun_style_launch(corpus_prefix, tmp_path):
    """srun starts each rank itself: rank 0's process hosts the rendezvous store, so a stopped rank 0
    also silences the store; rank 1 must say so and exit (srun --kill-on-bad-exit ends the rest)."""
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "SLURM_NTASKS": "2",
            "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        base.pop(key, None)
    cmd = [sys.executable, os.path.join(REPO, "scripts", "pretrain_gpt.py"), "--data-path", corpus_prefix, *TINY,
           "--train-iters", "100000", "--log-interval", "5", "--eval-interval", "100000",
           "--watchdog-timeout", str(TIMEOUT)]
    logs = [tmp_path / f"rank{r}.txt" for r in range(2)]
    procs = []
    for r, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=str(tmp_path),
                                          env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}))
    try:
        _wait_for(logs[0], r" iteration +\d+/", procs)
        os.kill(procs[0].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        code = procs[1].wait(timeout=TIMEOUT + 90)
        gone = time.monotonic() - stopped
    finally:
        _end(procs)
    out = logs[1].read_text(errors="replace")
    assert code == EXIT_CODE, out[-4000:]
    assert gone <= TIMEOUT + 30, out[-4000:]
    assert re.search(r"rank 1: not arrived: the rendezvous store at 127\.0\.0\.1:\d+ \(hosted by rank 0's process\) "
                     r"has not answered for [\d.]+ s", out), out[-4000:]


def _deadlocked_pair(script: str, timeout: int, *extra: str) -> tuple[subprocess.CompletedProcess, str, float]:
    """`script` (in this directory) under torchrun on 2 ranks: the run, its output and seconds taken."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(HERE, script), str(timeout), *extra]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, proc.stdout + proc.stderr, time.monotonic() - start


def test_deadlock_with_incomplete_waits_is_found(tmp_path):
    """Every rank waits, none is stopped: the watchdog calls it a deadlock and the job exits."""
    proc, out, took = _deadlocked_pair("deadlocked_ranks.py", 5)
    assert proc.returncode != 0 and "receive pending: True" in out, out[-4000:]
    assert re.search(r"rank (\d): p2p recv from rank \d has waited [\d.]+ s \(timeout 5 s\)", out), out[-4000:]
    assert re.search(r"not arrived: no rank is stopped, but every rank is waiting .*: rank \d \(waiting [\d.]+ s; "
                     r"last seen in p2p recv from rank \d", out), out[-4000:]
    assert took < 60, f"took {took:.0f} s:\n{out[-4000:]}"


def test_pipeline_stages_waiting_on_shared_memory_are_found(tmp_path):
    """The pipeline's shared-memory transport waits in poll(), not in a gloo work: both stages
    waiting on each other are still a deadlock the watchdog names, and the job exits."""
    proc, out, took = _deadlocked_pair("stuck_stages.py", 5, "shm")
    assert proc.returncode != 0 and "rank 0: links through shared memory with [1]" in out, out[-4000:]
    assert re.search(r"rank \d: p2p recv (forward|backward) \(the (previous|next) stage's (output|gradient)\) has "
                     r"waited [\d.]+ s \(timeout 5 s\)", out), out[-4000:]
    assert "not arrived: no rank is stopped, but every rank is waiting" in out, out[-4000:]
    assert took < 60, f"took {took:.0f} s:\n{out[-4000:]}"


def test_a_rank_at_the_end_of_run_barrier_while_a_peer_still_waits_is_a_deadlock(tmp_path):
    """The recipe's last barrier is a watched operation: a rank there is waiting, not computing, so
    a peer stuck in an operation it skipped is named instead of hanging the job silently."""
    proc, out, took = _deadlocked_pair("stuck_stages.py", 5, "end_barrier")
    assert proc.returncode != 0 and "rank 1: at the end of the run" in out, out[-4000:]
    assert "not arrived: no rank is stopped, but every rank is waiting" in out, out[-4000:]
    assert "barrier (end of the run)" in out, out[-4000:]
    assert took < 60, f"took {took:.0f} s:\n{out[-4000:]}"


@pytest.mark.slow
def test_slow_checkpoint_save_and_evaluation_do_not_trip_it(corpus_prefix, tmp_path):
    """Rank 1's first fsync in a checkpoint save and rank 0's first evaluation batch each stall for 1.5x
    the timeout, while the other rank waits for it in a collective: alive peers are waited for. The
    timeout is the config's least (5 s; test_deadlock_with_incomplete_waits_is_found's too): the
    claim is relative to it, and each second of it is three of sleeping here."""
    timeout = 5
    stall = 1.5 * timeout
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGAZERO_TEST_STALL": str(stall),
           "MEGAZERO_TEST_SLOW_FSYNC_RANK": "1", "MEGAZERO_TEST_SLOW_EVAL_RANK": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(HERE, "stalled_rank.py"), os.path.join(REPO, "scripts", "pretrain_gpt.py"),
           "--data-path", corpus_prefix, *TINY, "--train-iters", "20", "--log-interval", "5",
           "--eval-interval", "10", "--eval-iters", "2", "--save", str(tmp_path / "ckpt"), "--save-interval", "10",
           "--tensorboard-dir", str(tmp_path / "tb"), "--watchdog-timeout", str(timeout)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"[stalled_rank] rank 1: fsync in a checkpoint save stalls {stall} s, watchdog on" in out, out[-4000:]
    assert f"[stalled_rank] rank 0: evaluation stalls {stall} s, watchdog on" in out, out[-4000:]
    assert "[megazero watchdog]" not in out, out[-4000:]
    assert "iteration     20/20" in out and took > 2 * stall
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["global_step10", "global_step20", "latest"]


def test_config_block_bounds_and_recipe_flag(tmp_path):
    """Off when absent, bounded timeout, on in the recipes' configs; --watchdog-timeout sets or disables it."""
    config = parse_config({"train_batch_size": 8}, 1)
    assert (config.watchdog.enabled, config.watchdog.timeout) == (False, 60.0)
    with pytest.raises(ConfigError, match=r"'watchdog.timeout' must be >= 5.0, got 1.0"):
        parse_config({"train_batch_size": 8, "watchdog": {"timeout": 1}}, 1)
    with pytest.raises(ConfigError, match=r"unknown key 'watchdog.timout' \(did you mean 'timeout'\?\)"):
        parse_config({"train_batch_size": 8, "watchdog": {"timout": 30}}, 1)
    for name in ("ds_gpt2_cpu.json", "ds_bert_cpu.json"):
        with open(os.path.join(REPO, "configs", name)) as f:
            assert json.load(f)["watchdog"] == {"enabled": True, "timeout": 60}, name

    from megazero.config.cli import parse_run
    from megazero.config.run import RunConfig

    def watchdog(*flags: str):
        run = parse_run(RunConfig, ["--data-path", "unused", *flags],
                        os.path.join(REPO, "configs", "run_gpt2_cpu.json"))
        return parse_config(run.engine, 1).watchdog

    assert (watchdog().enabled, watchdog().timeout) == (True, 60.0)
    assert (watchdog("--watchdog-timeout", "15").enabled, watchdog("--watchdog-timeout", "15").timeout) == (True, 15.0)
    assert not watchdog("--watchdog-timeout", "0").enabled
