"""sbatch recipes against a real Slurm (ci/slurm/setup.sh starts one; .ci/run does it in CI).

Skipped with a reason where no Slurm controller answers, unless MEGAZERO_REQUIRE_SLURM=1.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SBATCH = os.path.join(REPO, "scripts", "pretrain_gpt2.sbatch")
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--global-batch-size", "8", "--micro-batch-size", "4", "--lr", "0.005", "--log-interval", "5",
        "--eval-interval", "1000", "--eval-iters", "2", "--save-interval", "1000", "--peak-flops", "1e11",
        "--sample-tokens", "10"]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE"}


def _slurm_answers() -> str | None:
    if shutil.which("sinfo") is None:
        return "Slurm client commands are not installed"
    proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        return f"no Slurm controller answers (sinfo: {proc.stderr.strip() or 'no nodes'})"
    return None


_why_not = _slurm_answers()
if _why_not and os.environ.get("MEGAZERO_REQUIRE_SLURM") == "1":
    raise RuntimeError(f"MEGAZERO_REQUIRE_SLURM=1 but {_why_not}")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_why_not is not None, reason=f"{_why_not}; start one with ci/slurm/setup.sh")]


def submit(tmp_path, corpus_prefix: str, env: dict, sbatch_flags: list[str] = (), args: list[str] = ()) -> str:
    """sbatch the GPT-2 recipe with a tiny model; returns the job id."""
    full_env = {**os.environ, "MEGAZERO_DIR": REPO, "DATA_PATH": corpus_prefix,
                "SAVE_DIR": str(tmp_path / "ckpt"), "TB_DIR": str(tmp_path / "tb"), **env}
    cmd = ["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out", *sbatch_flags, SBATCH, *TINY, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait(job_id: str, timeout: float = 300.0) -> dict[str, str]:
    """Poll scontrol every second (sbatch --wait backs off to tens of seconds) until the job ends."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        fields = job_fields(job_id)
        if fields.get("JobState") in TERMINAL:
            return fields
        time.sleep(1.0)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} did not finish within {timeout}s: {job_fields(job_id)}")


def log_of(tmp_path, job_id: str) -> str:
    return (tmp_path / f"slurm-{job_id}.out").read_text()


def losses(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| lm loss: ([0-9.]+) \| learning rate", log)]


def assert_completed(fields: dict, log: str) -> None:
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{fields}\n{log[-4000:]}"


def test_single_node_srun_trains_and_resubmission_resumes(tmp_path, corpus_prefix):
    job = submit(tmp_path, corpus_prefix, {"TRAIN_ITERS": "30"})
    fields = wait(job)
    log = log_of(tmp_path, job)
    assert_completed(fields, log)
    assert "launcher srun" in log and "2 ranks" in log
    values = losses(log)
    assert len(values) == 6 and values[-1] < values[0], log
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step30"

    again = submit(tmp_path, corpus_prefix, {"TRAIN_ITERS": "40"})
    fields = wait(again)
    log = log_of(tmp_path, again)
    assert_completed(fields, log)
    assert "resuming from" in log and "at iteration 30" in log and "iteration     40/40" in log
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step40"


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_two_emulated_nodes(tmp_path, corpus_prefix, launcher):
    job = submit(tmp_path, corpus_prefix, {"TRAIN_ITERS": "10", "LAUNCHER": launcher, "NPROC_PER_NODE": "1"},
                 ["--nodes=2", "--ntasks-per-node=1"])
    fields = wait(job)
    log = log_of(tmp_path, job)
    assert_completed(fields, log)
    assert fields["NodeList"] == "n[1-2]" and f"launcher {launcher}, master n1:" in log
    assert "2 ranks" in log and "iteration     10/10" in log


def test_signal_before_the_time_limit_saves_and_exits_cleanly(tmp_path, corpus_prefix):
    job = submit(tmp_path, corpus_prefix, {"TRAIN_ITERS": "100000"})
    deadline = time.time() + 180
    while not re.search(r"iteration +10/", log_of(tmp_path, job) if (tmp_path / f"slurm-{job}.out").exists()
                        else ""):
        assert time.time() < deadline and job_fields(job).get("JobState") not in TERMINAL, log_of(tmp_path, job)
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    fields = wait(job)
    log = log_of(tmp_path, job)
    assert_completed(fields, log)
    saved = re.search(r"received SIGUSR1: checkpoint saved at iteration (\d+), exiting", log)
    assert saved, log[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"global_step{saved.group(1)}"
