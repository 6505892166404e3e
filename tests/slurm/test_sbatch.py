"""The launchers submitted as users type them, against a real Slurm (ci/slurm/setup.sh starts one;
.ci/run does it in CI): `sbatch [README's sbatch flags] scripts/<launcher> [recipe flags]` from the
repository root, with the default output path, the log read where that default puts it.

Skipped with a reason where no Slurm controller answers, unless MEGAZERO_REQUIRE_SLURM=1.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import pytest

from tests.conftest import REPO
from tests.slurm.launchers import (
    DEFAULT_ARRAY_LOG,
    DEFAULT_LOG,
    SMALL_VOCAB,
    TINY_FLAGS,
    dataset_files,
    ensure_data,
    losses,
    one_preprocess_run,
    small_corpus,
    user_env,
)

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


class Job:
    """One submitted job: its id, and its log where the launcher's default output path puts it."""

    def __init__(self, job_id: str, log_path: str):
        self.id, self.log_path = job_id, log_path

    def log(self) -> str:
        return open(self.log_path).read() if os.path.exists(self.log_path) else ""

    def fields(self) -> dict[str, str]:
        out = subprocess.run(["scontrol", "show", "job", "-o", self.id], capture_output=True, text=True).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, timeout: float = 300.0) -> dict[str, str]:
        """Poll scontrol every second (sbatch --wait backs off to tens of seconds) until the job ends."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            fields = self.fields()
            if fields.get("JobState") in TERMINAL:
                return fields
            time.sleep(1.0)
        subprocess.run(["scancel", self.id])
        raise AssertionError(f"job {self.id} did not finish within {timeout}s: {self.fields()}\n{self.log()[-3000:]}")

    def assert_completed(self) -> str:
        """Wait, check the job succeeded and that Slurm wrote its log where the default says; the log."""
        fields = self.wait()
        log = self.log()
        assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{fields}\n{log[-4000:]}"
        assert fields["StdOut"] == self.log_path, fields
        return log


@pytest.fixture()
def submit():
    """submit(launcher, recipe flags, env, sbatch flags, cwd, script) runs `sbatch [flags] SCRIPT [recipe
    flags]` in cwd (the repository root unless given), SCRIPT being scripts/<launcher> as typed there;
    the logs are removed afterwards."""
    jobs: list[Job] = []

    def run(launcher: str, args=(), env: dict | None = None, sbatch_flags=(), cwd: str = REPO,
            script: str | None = None) -> Job:
        ensure_data(launcher)
        cmd = ["sbatch", *sbatch_flags, script or f"scripts/{launcher}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=user_env(env or {}), cwd=cwd)
        assert proc.returncode == 0, proc.stderr
        job_id = re.fullmatch(r"Submitted batch job (\d+)\s*", proc.stdout).group(1)
        job = Job(job_id, os.path.join(cwd, DEFAULT_LOG[launcher].format(job=job_id)))
        jobs.append(job)
        return job

    yield run
    for job in jobs:
        if os.path.exists(job.log_path):
            os.remove(job.log_path)


def recipe_env(tmp_path, **extra: str) -> dict[str, str]:
    """Checkpoints and TensorBoard in tmp_path (SAVE_DIR, TB_DIR: the README's variables)."""
    return {"SAVE_DIR": str(tmp_path / "ckpt"), "TB_DIR": str(tmp_path / "tb"), **extra}


def test_sbatch_recipe_trains_and_resubmission_resumes(tmp_path, submit):
    flags = TINY_FLAGS["pretrain_gpt2.sbatch"]
    log = submit("pretrain_gpt2.sbatch", flags, recipe_env(tmp_path, TRAIN_ITERS="20")).assert_completed()
    assert "launcher srun" in log and "2 ranks" in log
    values = losses(log)
    assert len(values) == 4 and values[-1] < values[0], log
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step20"

    log = submit("pretrain_gpt2.sbatch", flags, recipe_env(tmp_path, TRAIN_ITERS="25")).assert_completed()
    assert "resuming from" in log and "at iteration 20" in log and "iteration     25/25" in log
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step25"


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_two_emulated_nodes(tmp_path, submit, launcher):
    job = submit("pretrain_gpt2.sbatch", TINY_FLAGS["pretrain_gpt2.sbatch"],
                 recipe_env(tmp_path, TRAIN_ITERS="10", LAUNCHER=launcher, NPROC_PER_NODE="1"),
                 ["--nodes=2", "--ntasks-per-node=1"])
    log = job.assert_completed()
    assert job.fields()["NodeList"] == "n[1-2]" and f"launcher {launcher}, master n1:" in log
    assert "2 ranks" in log and "iteration     10/10" in log


def test_llama_at_tp2_on_two_nodes_then_resumes_at_dp2(tmp_path, submit):
    # docs/launchers.md's worked example, with the tiny model: `sbatch --nodes=2 --ntasks-per-node=1
    # scripts/pretrain_llama.sbatch --tensor-model-parallel-size 2`, one rank per node; then
    # `sbatch scripts/pretrain_llama.sbatch` (its header: one node, two tasks) continues at DP=2
    flags = TINY_FLAGS["pretrain_llama.sbatch"]
    job = submit("pretrain_llama.sbatch", (*flags, "--tensor-model-parallel-size", "2"),
                 recipe_env(tmp_path, TRAIN_ITERS="10"), ["--nodes=2", "--ntasks-per-node=1"])
    log = job.assert_completed()
    assert job.fields()["NodeList"] == "n[1-2]" and "2 task(s), launcher srun, master n1:" in log, log
    assert re.search(r"Llama: [0-9,]+ parameters, 2 ranks = TP 2 x PP 1 x DP 1, .*2 key/value groups for 4 heads",
                     log), log
    assert "iteration     10/10" in log and len(losses(log)) == 2, log
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step10"

    job = submit("pretrain_llama.sbatch", flags, recipe_env(tmp_path, TRAIN_ITERS="15"))
    log = job.assert_completed()
    assert job.fields()["NumNodes"] == "1" and "2 ranks = TP 1 x PP 1 x DP 2" in log, log
    assert "resuming from" in log and "at iteration 10" in log and "iteration     15/15" in log, log
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step15"


def test_signal_before_the_time_limit_saves_and_exits_cleanly(tmp_path, submit):
    job = submit("pretrain_gpt2.sbatch", TINY_FLAGS["pretrain_gpt2.sbatch"],
                 recipe_env(tmp_path, TRAIN_ITERS="100000"))
    deadline = time.time() + 180
    while not re.search(r"iteration +10/", job.log()):
        assert time.time() < deadline and job.fields().get("JobState") not in TERMINAL, job.log()
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", job.id], check=True)
    log = job.assert_completed()
    saved = re.search(r"received SIGUSR1: checkpoint saved at iteration (\d+), exiting", log)
    assert saved, log[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"global_step{saved.group(1)}"


@pytest.mark.parametrize("launcher,sbatch_flags,ranks", [("pretrain_gpt2.sh", [], 1), ("pretrain_llama.sh", [], 1),
                                                         ("pretrain_bert.sh", [], 1),
                                                         ("pretrain_gpt2.sh", ["--ntasks=2"], 2)],
                         ids=["gpt2", "llama", "bert", "gpt2-ntasks2"])
def test_sh_launcher_runs_one_rank_per_slurm_task(tmp_path, submit, launcher, sbatch_flags, ranks):
    job = submit(launcher, (*TINY_FLAGS[launcher], "--train-iters", "10"), recipe_env(tmp_path), sbatch_flags)
    log = job.assert_completed()
    assert f"{ranks} task(s), launcher srun" in log and f"{ranks} ranks" in log, log
    assert "iteration     10/10" in log and len(losses(log)) == 2, log
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step10"


@pytest.mark.parametrize("launcher", ["pretrain_gpt2.sh", "pretrain_bert.sh"])
def test_submitting_from_outside_the_repository_names_the_problem(tmp_path, submit, launcher):
    job = submit(launcher, cwd=str(tmp_path), script=os.path.join(REPO, "scripts", launcher))
    fields = job.wait()
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0", fields
    assert f"error: {tmp_path} is not the megazero repository" in job.log(), job.log()


class ArrayJob:
    """One submitted array job: its id, and each task's log where the launcher's header puts it."""

    def __init__(self, job_id: str, log_paths: dict[str, str]):
        self.id, self.log_paths = job_id, log_paths

    def logs(self) -> dict[str, str]:
        return {task: open(path).read() if os.path.exists(path) else "" for task, path in self.log_paths.items()}

    def wait(self, timeout: float = 120.0) -> dict[str, dict[str, str]]:
        """Poll scontrol every second until every task has ended: task id -> its fields."""
        deadline = time.time() + timeout
        tasks: dict[str, dict[str, str]] = {}
        while time.time() < deadline:
            out = subprocess.run(["scontrol", "show", "job", "-o", self.id], capture_output=True, text=True).stdout
            # pending tasks show as one record (ArrayTaskId=0-1) until they start
            tasks = {f["ArrayTaskId"]: f for f in (dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines())
                     if "ArrayTaskId" in f}
            if tasks.keys() == self.log_paths.keys() and all(f.get("JobState") in TERMINAL for f in tasks.values()):
                for task, fields in tasks.items():
                    assert fields["StdOut"] == self.log_paths[task], fields
                return tasks
            time.sleep(1.0)
        subprocess.run(["scancel", self.id])
        raise AssertionError(f"array job {self.id} did not finish within {timeout}s: {tasks}\n{self.logs()}")


@pytest.fixture()
def submit_array():
    """submit_array(launcher, env, tasks) runs `sbatch --array=0-<tasks-1> scripts/<launcher>` from the
    repository root; the tasks' logs are removed afterwards."""
    jobs: list[ArrayJob] = []

    def run(launcher: str, env: dict[str, str], tasks: int) -> ArrayJob:
        proc = subprocess.run(["sbatch", f"--array=0-{tasks - 1}", f"scripts/{launcher}"], capture_output=True,
                              text=True, env=user_env(env), cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        job_id = re.fullmatch(r"Submitted batch job (\d+)\s*", proc.stdout).group(1)
        log = os.path.join(REPO, DEFAULT_ARRAY_LOG[launcher])
        jobs.append(ArrayJob(job_id, {str(t): log.format(job=job_id, task=t) for t in range(tasks)}))
        return jobs[-1]

    yield run
    for job in jobs:
        for path in job.log_paths.values():
            if os.path.exists(path):
                os.remove(path)


def test_sbatch_array_tokenizes_in_parts_and_the_last_task_merges(tmp_path, submit_array):
    # the header's second usage line: INPUT and OUTPUT_PREFIX set, the array's size chosen on the
    # command line; 3 files in 2 blocks, the tasks on the two nodes at once (2 CPUs each)
    inputs = small_corpus(tmp_path / "corpus")
    prefix = str(tmp_path / "out" / "corpus")
    job = submit_array("preprocess_data.sbatch",
                       {"INPUT": " ".join(inputs), "OUTPUT_PREFIX": prefix, "VOCAB_SIZE": SMALL_VOCAB}, 2)
    tasks, logs = job.wait(), job.logs()
    for task, fields in tasks.items():
        assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{fields}\n{logs[task][-3000:]}"
    assert sum("merged 2 partitions into" in log for log in logs.values()) == 1, logs
    written = dataset_files(prefix)
    assert len(written) == 5, sorted(written)
    assert written == one_preprocess_run(inputs, str(tmp_path / "one" / "corpus"), prefix + "_tokenizer.model")
    left = sorted(n for n in os.listdir(tmp_path / "out") if n.endswith(("training", "merging", f".{job.id}")))
    assert not left, f"markers left behind: {left}"


def test_sbatch_array_tasks_stop_when_task_0_has_no_tokenizer(tmp_path, submit_array):
    # task 1 stops at once instead of waiting WAIT_MINUTES for a tokenizer that will not come
    missing = str(tmp_path / "missing.model")
    job = submit_array("preprocess_data.sbatch", {"INPUT": " ".join(small_corpus(tmp_path / "corpus")),
                                                  "OUTPUT_PREFIX": str(tmp_path / "out" / "corpus"),
                                                  "TOKENIZER": missing}, 2)
    tasks, logs = job.wait(timeout=60), job.logs()
    assert [tasks[t]["JobState"] for t in "01"] == ["FAILED", "FAILED"], tasks
    assert tasks["0"]["ExitCode"] == "2:0" and f"error: TOKENIZER={missing} not found" in logs["0"], logs
    assert tasks["1"]["ExitCode"] == "1:0", tasks
    assert f"error: task 1 has no tokenizer: task 0 of job {job.id}: TOKENIZER={missing} not found" in logs["1"], logs
