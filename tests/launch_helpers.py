"""Recipe launches for the tests: started as subprocesses, waited for together. Independent
launches run side by side: one torchrun launch leaves the 2 cores idle part of the time (its
agent's start-up, the rendezvous, collectives), so two at once take less than one after another."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO


def torchrun(script: str, *flags: str, nproc: int = 2) -> list[str]:
    """The command that runs scripts/<script> under `torchrun --standalone` on nproc processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            os.path.join(REPO, "scripts", script), *flags]


def start(cmd: list[str], cwd) -> subprocess.Popen:
    """cmd started in cwd, one thread per process (the ranks share the cores)."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=str(cwd))


def finish(*procs: subprocess.Popen, timeout: float = 600) -> list[str]:
    """Each started run's stdout + stderr once every one has succeeded (an assertion with the
    failed run's output otherwise); none is left running."""
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, out[-3000:] + err[-5000:]
            outputs.append(out + err)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return outputs
