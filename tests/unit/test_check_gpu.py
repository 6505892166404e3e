"""scripts/check_gpu.py (`make check-gpu`) where it can run without a GPU: it says there is none
(exit 2), its steps share one time budget (a step that would not fit is reported as not run, one
that overruns is stopped), and with one GPU it names the multi-rank runs it cannot do."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO


def _load():
    spec = importlib.util.spec_from_file_location("check_gpu", os.path.join(REPO, "scripts", "check_gpu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without a GPU")
def test_without_a_gpu_it_says_so(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "check_gpu.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"torch {torch.__version__}" in run.stdout and "nothing to check here" in run.stdout


def test_steps_share_the_time_budget(tmp_path):
    check_gpu = _load()
    check = check_gpu.Check(str(tmp_path), budget=3.0)
    rc, _ = check.run("quick step", [sys.executable, "-c", "print('hello from the step')"], 60)
    assert rc == 0 and "hello from the step" in check.tail("quick step")
    rc, seconds = check.run("slow step", [sys.executable, "-c", "import time; time.sleep(30)"], 60)
    assert rc is None and seconds < 20  # stopped when the budget ran out, not after its own 60 s
    assert not check.fits("late step", 10)
    assert check.rows[-1]["step"] == "late step" and check.rows[-1]["result"] == "NOT RUN"


def test_one_gpu_lists_the_multi_rank_runs_not_done(tmp_path):
    check_gpu = _load()
    check = check_gpu.Check(str(tmp_path), budget=60.0)
    check_gpu.step_multi_rank(check, gpus=1)
    row = check.rows[-1]
    assert row["result"] == "NOT RUN" and "1 GPU visible" in row["numbers"]
    assert "pipeline p2p" in row["numbers"] and "ZeRO-2" in row["numbers"] and "tensor parallel" in row["numbers"]
