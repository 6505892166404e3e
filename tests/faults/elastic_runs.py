"""What the elastic-restart fault tests share: a launcher run whose output is read line by line as it
arrives (with the time of each line), the ranks' processes found under it, SIGKILL sent to one of
them, and the comparison of two saved checkpoints tensor by tensor."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import threading
import time

import torch

from tests.conftest import REPO

# a 2-layer GPT with dropout on, logging every iteration and saving every 2; never evaluating before
# the end (evaluation draws no random numbers, but it would slow the run down)
ELASTIC_FLAGS = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                 "--global-batch-size", "8", "--micro-batch-size", "4", "--lr", "0.005", "--dropout", "0.1",
                 "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1", "--save-interval", "2",
                 "--sample-tokens", "4", "--peak-flops", "1e11")
ITERATION = re.compile(r"^ iteration +(\d+)/(\d+) \|")
RESUMED = re.compile(r"resumed from (\S+) at iteration (\d+)")


def fault_seed() -> int:
    """MEGAZERO_FAULT_SEED when set (to replay a failure), else a fresh one; the tests print it."""
    value = os.environ.get("MEGAZERO_FAULT_SEED")
    return int(value) if value else random.SystemRandom().randrange(2**31)


class LauncherRun:
    """`cmd` started in its own session (so that a timeout can end torchrun and every worker), with
    stdout and stderr read together, line by line, each line kept with the time it arrived."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: str = REPO):
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=cwd, start_new_session=True, bufsize=1)
        self.lines: list[tuple[float, str]] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append((time.time(), line.rstrip("\n")))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def output(self) -> str:
        """Everything printed so far."""
        with self._changed:
            return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: re.Pattern, after: float = 0.0, timeout: float = 300.0) -> tuple[float, re.Match]:
        """(arrival time, match) of the first line at or after time `after` that matches `pattern`."""
        deadline = time.time() + timeout
        seen = 0
        with self._changed:
            while True:
                for arrived, line in self.lines[seen:]:
                    match = pattern.search(line)
                    if match and arrived >= after:
                        return arrived, match
                seen = len(self.lines)
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(f"{pattern.pattern!r} never printed; the run exited with "
                                         f"{self.proc.returncode}:\n{self.output()[-4000:]}")
                if time.time() > deadline:
                    self.kill()
                    raise AssertionError(f"{pattern.pattern!r} not printed within {timeout}s:\n{self.output()[-4000:]}")
                self._changed.wait(0.5)

    def worker_pids(self) -> dict[int, int]:
        """{global rank: pid} of torchrun's workers now running (the launcher execs torchrun, so they
        are the children of its process that have RANK in their environment)."""
        workers = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                if ppid != self.proc.pid:
                    continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue  # exited meanwhile
            if b"RANK" in env:
                workers[int(env[b"RANK"])] = int(entry)
        return workers

    def kill_rank(self, rank: int, pids: dict[int, int] | None = None) -> float:
        """SIGKILL global rank `rank` (pids: from worker_pids(), found beforehand to kill at once);
        returns the time it was sent."""
        pids = pids or self.worker_pids()
        assert rank in pids, f"rank {rank} is not running (workers {pids}):\n{self.output()[-3000:]}"
        os.kill(pids[rank], signal.SIGKILL)
        return time.time()

    def finish(self, timeout: float = 600.0) -> int:
        """Wait for the run to exit; its exit status. On timeout, kill the whole session and fail."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{' '.join(self.cmd)} did not finish within {timeout}s:\n"
                                 f"{self.output()[-4000:]}") from None
        self._reader.join(timeout=10)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the run's whole session (torchrun and its workers)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def iterations_printed(lines: list[tuple[float, str]], before: float) -> list[int]:
    """The iterations of the progress lines that arrived before time `before`."""
    return [int(m.group(1)) for arrived, line in lines if arrived < before and (m := ITERATION.search(line))]


def directory_bytes(path: str) -> int:
    """Total size of the files under `path` (0 when it does not exist)."""
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def tensors_of(value, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested dict/list of a checkpoint file, by its path of keys."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    found = {}
    for key, item in items:
        found.update(tensors_of(item, f"{prefix}/{key}"))
    return found


def differing_tensors(a_path: str, b_path: str) -> list[str]:
    """Names of the tensors that are not torch.equal (same dtype, shape and bits) between two checkpoint
    files, and of those only one of them holds; [] when every tensor is equal."""
    a = tensors_of(torch.load(a_path, map_location="cpu", weights_only=True))
    b = tensors_of(torch.load(b_path, map_location="cpu", weights_only=True))
    assert a, f"{a_path} holds no tensors"
    only = sorted(set(a) ^ set(b))
    unequal = [name for name in sorted(set(a) & set(b))
               if a[name].dtype != b[name].dtype or not torch.equal(a[name], b[name])]
    return only + unequal
