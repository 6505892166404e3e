"""The recipe over a full disk: a failed save stops the run with the file and errno, or with
--continue-on-save-failure is a warning and training goes on (a real 256 KiB tmpfs as --save)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow


@pytest.fixture()
def small_disk(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.decode().strip()})")
    yield str(mount)
    subprocess.run(["umount", str(mount)], check=True)


def _recipe(corpus_prefix: str, save: str, cwd, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(REPO, "scripts", "pretrain_gpt.py"), "--data-path", corpus_prefix,
           "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
           "--global-batch-size", "4", "--micro-batch-size", "4", "--train-iters", "4", "--log-interval", "1",
           "--eval-interval", "4", "--eval-iters", "1", "--save", save, "--save-interval", "2",
           "--peak-flops", "1e11", "--sample-tokens", "4", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(cwd),
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_full_disk_stops_the_recipe_naming_file_and_errno(corpus_prefix, small_disk, tmp_path):
    proc = _recipe(corpus_prefix, small_disk, tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "checkpoint save failed at iteration 2" in last and "ENOSPC" in last and small_disk in last, last
    assert " iteration      3/" not in proc.stdout  # stopped at the failed save
    assert os.listdir(small_disk) == []  # nothing published, the temporary directory removed


def test_continue_on_save_failure_warns_and_trains_on_but_the_last_save_must_succeed(corpus_prefix, small_disk,
                                                                                     tmp_path):
    proc = _recipe(corpus_prefix, small_disk, tmp_path, "--continue-on-save-failure")
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("WARNING: checkpoint save failed")]
    assert len(warnings) == 1 and "iteration 2" in warnings[0] and "ENOSPC" in warnings[0], proc.stdout[-3000:]
    assert " iteration      4/" in proc.stdout and "validation at iteration 4" in proc.stdout
    # the final save fails too: no exit 0 without the run's final state
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "checkpoint save failed at iteration 4, the run's last save" in last and "ENOSPC" in last, last
    assert os.listdir(small_disk) == []
