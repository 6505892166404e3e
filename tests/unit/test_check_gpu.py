"""scripts/check_gpu.py (the one command for a lent GPU machine) rehearsed on the CPU with real
subprocesses: without a GPU it prints its plan, writes summary.json (and the log tarball) to $OUT
and exits 2; its caps add up to its budget; a step that overruns is killed with its whole process
group, one that raises is reported and the others still run, and the table and summary.json always
appear; every child sees the carried wheels; a missing dependency is one line. Also the GPU
scripts it runs: benchmarks/gpu_train.py's ZeRO and multi-rank checks on the CPU (gloo), and
benchmarks/gpu_ops.py's answer without a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile

import pytest
import torch

from tests.conftest import REPO, repo_pythonpath

SCRIPT = os.path.join(REPO, "scripts", "check_gpu.py")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without a GPU")


def _load():
    spec = importlib.util.spec_from_file_location("check_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_script(tmp_path, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    out = tmp_path / "OUT"
    env = {**os.environ, "OUT": str(out), **(extra_env or {})}
    return subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


@no_gpu
def test_without_a_gpu_it_prints_the_plan_writes_summary_and_exits_2(tmp_path):
    (tmp_path / "tmp").mkdir()
    run = _run_script(tmp_path, {"TMPDIR": str(tmp_path / "tmp")})
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"torch {torch.__version__}" in run.stdout and "nothing to check here" in run.stdout
    assert "plan, budget 300 s" in run.stdout and all(step in run.stdout for step in _load().CAPS)
    assert "nvcc: " in run.stdout and "ninja: " in run.stdout and "c++: " in run.stdout
    summary = json.loads((tmp_path / "OUT" / "summary.json").read_text())
    assert summary["problem"].startswith("no GPU") and len(summary["plan"]) == len(_load().CAPS) + 1
    assert tarfile.is_tarfile(tmp_path / "OUT" / "check_gpu_logs.tar.gz")
    assert sorted(os.listdir(tmp_path / "OUT")) == ["check_gpu_logs.tar.gz", "summary.json"]
    assert os.listdir(tmp_path / "tmp") == []  # its temporary log folder is gone


def test_a_missing_dependency_is_one_line_before_anything_runs(tmp_path):
    hidden = tmp_path / "hidden" / "pydantic"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError(\"No module named 'pydantic' (hidden by the test)\")\n")
    run = _run_script(tmp_path, {"PYTHONPATH": str(tmp_path / "hidden")})
    assert run.returncode == 2, run.stdout + run.stderr
    assert "python modules missing: megazero (ImportError: No module named 'pydantic'" in run.stdout
    assert "Traceback" not in run.stdout + run.stderr and "make gpu-wheels" in run.stdout


def test_caps_add_up_to_the_budget_and_the_plan_says_what_a_smaller_one_leaves():
    check_gpu = _load()
    assert sum(check_gpu.CAPS.values()) == check_gpu.BUDGET_S == 300
    assert [name for name, _ in check_gpu.STEPS] == list(check_gpu.CAPS)
    lines = check_gpu.plan(150)
    assert "budget leaves" not in lines[0] and "budget leaves 40 s" in lines[1] and "budget leaves 0 s" in lines[2]


def test_steps_share_the_time_budget(tmp_path):
    check_gpu = _load()
    check = check_gpu.Check(str(tmp_path), budget=3.0)
    rc, _ = check.run("quick step", [sys.executable, "-c", "print('hello from the step')"], 60)
    assert rc == 0 and "hello from the step" in check.tail("quick step")
    rc, seconds = check.run("slow step", [sys.executable, "-c", "import time; time.sleep(30)"], 60)
    assert rc is None and seconds < 20  # stopped when the budget ran out, not after its own 60 s
    assert not check.fits("late step", 10)
    assert check.rows[-1]["step"] == "late step" and check.rows[-1]["result"] == "NOT RUN"


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting to be reaped by whoever adopted it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_step_that_overruns_is_killed_with_its_whole_process_group(tmp_path):
    check_gpu = _load()
    check = check_gpu.Check(str(tmp_path), budget=60.0)
    spawner = ("import subprocess, sys, time\n"
               "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
               "print('grandchild', child.pid, flush=True)\n"
               "time.sleep(120)\n")
    rc, seconds = check.run("spawner", [sys.executable, "-c", spawner], 3)
    assert rc is None and seconds < 15
    pid = int(check.tail("spawner").split()[1])
    time.sleep(0.5)
    assert _dead(pid)  # the compiler a build started, a rank a step spawned: gone too


def test_a_failing_step_leaves_the_others_the_table_and_the_outputs(tmp_path, monkeypatch, capsys):
    check_gpu = _load()
    monkeypatch.setattr(check_gpu, "CARRIED_WHEELS", str(tmp_path / "no-wheels"))
    monkeypatch.setattr(check_gpu, "preflight", lambda: (None, 1, ["a rehearsal machine, 1 x no GPU"]))

    def passes(check):
        rc, seconds = check.run("build", [sys.executable, "-c", "print('built')"], 10)
        check.add("build", "PASS" if rc == 0 else "FAIL", seconds, "")

    def raises(check):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def sleeps(check):
        rc, seconds = check.run("fused GPT", [sys.executable, "-c", "import time; time.sleep(60)"], 60)
        check.add("fused GPT", "TIMEOUT" if rc is None else "PASS", seconds, "")

    monkeypatch.setattr(check_gpu, "STEPS", [("build", passes), ("cuda tests", raises), ("fused GPT", sleeps),
                                             ("ZeRO nccl vs gloo", check_gpu.step_zero)])
    monkeypatch.setenv("OUT", str(tmp_path / "OUT"))
    assert check_gpu.main(["--budget", "4"]) == 1
    rows = {r["step"]: r["result"] for r in json.loads((tmp_path / "OUT" / "summary.json").read_text())["rows"]}
    assert rows == {"build": "PASS", "cuda tests": "ERROR", "fused GPT": "TIMEOUT", "ZeRO nccl vs gloo": "NOT RUN",
                    "multi-rank": "NOT RUN"}
    printed = capsys.readouterr().out
    assert "RuntimeError: CUDA error: an illegal memory access" in printed and "total " in printed
    with tarfile.open(tmp_path / "OUT" / "check_gpu_logs.tar.gz") as tar:
        assert {"check_gpu/build.log", "check_gpu/fused_GPT.log", "check_gpu/summary.json"} <= set(tar.getnames())


def _wheel(path, name: str) -> None:
    """A minimal pure-python wheel holding module `name` (X = 42)."""
    dist = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path / f"{name}-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{name}.py", "X = 42\n")
        whl.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        whl.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}/RECORD", "")


def test_every_child_sees_the_carried_wheels_after_the_repository(tmp_path, monkeypatch):
    check_gpu = _load()
    (tmp_path / "whl").mkdir()
    _wheel(tmp_path / "whl", "carried_probe")
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # restored after the test
    monkeypatch.setattr(sys, "path", list(sys.path))
    line = check_gpu.install_carried_wheels(str(tmp_path / "whl"), str(tmp_path / "site"))
    assert line.startswith("1 carried wheels installed into")
    assert check_gpu.child_env()["PYTHONPATH"].split(os.pathsep)[:2] == [REPO, str(tmp_path / "site")]
    check = check_gpu.Check(str(tmp_path / "logs"), budget=60.0)
    probe = "import carried_probe, megazero.ops.builder; print('carried', carried_probe.X)"
    rc, _ = check.run("probe", [sys.executable, "-c", probe], 60)
    assert rc == 0 and "carried 42" in check.tail("probe"), check.tail("probe")


def test_the_cuda_tests_subprocesses_keep_the_parents_pythonpath(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/carried/site")
    assert repo_pythonpath().split(os.pathsep) == [REPO, "/carried/site"]


def test_gpu_train_zero_check_rehearsed_on_the_cpu(tmp_path):
    out = tmp_path / "zero.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_train", "zero", "gloo", "--device", "cpu", "--json",
                          str(out)], capture_output=True, text=True, cwd=REPO, timeout=600,
                         env={**os.environ, "PYTHONPATH": repo_pythonpath(), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    losses = json.loads(out.read_text())["losses"]
    assert sorted(losses) == ["0", "1", "2", "3"] and all(len(v) == 4 for v in losses.values())
    for stage in "123":  # the same model, data and dropout masks: every stage within fp32 rounding of stage 0
        assert max(abs(a - b) / abs(b) for a, b in zip(losses[stage], losses["0"])) < 1e-5, (stage, losses)


@no_gpu
def test_gpu_ops_says_there_is_no_gpu():
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_ops"], capture_output=True, text=True, cwd=REPO,
                         timeout=120, env={**os.environ, "PYTHONPATH": repo_pythonpath()})
    assert run.returncode == 1 and "no GPU (or a CPU build of torch): nothing to check here" in run.stderr
