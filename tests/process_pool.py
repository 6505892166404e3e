"""Run test functions in N real gloo processes, reusing the processes (and their process group)
across tests so each test pays for neither interpreter start-up nor rendezvous.

    results = pool.run(fn, *args)   # fn(*args) on every rank; returns [result of rank 0, 1, ...]

`fn` must be a module-level function (it is pickled by reference). If any rank raises, the error
is re-raised here with that rank's traceback; if ranks stop answering (e.g. one rank died inside a
collective), the pool is killed and the next use starts a fresh one.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankError(AssertionError):
    """A test function failed on one or more ranks."""


class ProcessPool:
    """`world_size` worker processes, each a rank of one gloo process group."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_worker, args=(r, self.world_size, port, self._tasks[r], self._results),
                                   daemon=True) for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float = 300.0) -> list:
        """fn(*args) on every rank; per-rank results in rank order."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        results, errors = {}, {}
        try:
            for _ in range(self.world_size):
                wait = timeout if not errors else 10.0  # after one failure, the rest may be stuck
                rank, ok, value = self._results.get(timeout=wait)
                (results if ok else errors)[rank] = value
        except queue.Empty:
            self.close()
            missing = sorted(set(range(self.world_size)) - set(results) - set(errors))
            if not errors:
                raise RankError(f"ranks {missing} did not finish {fn.__name__} within {timeout}s") from None
        if errors:
            self.close()
            details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankError(f"{fn.__name__} failed on ranks {sorted(errors)}:\n{details}")
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the workers (killing any that do not exit)."""
        for p, q in zip(self._procs, getattr(self, "_tasks", [])):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
