"""Issue 14, item 2 under Slurm: `sbatch scripts/pretrain_gpt2.sbatch` (its header asks for --requeue)
survives the failure of its node. The failure is made the way a crash looks from the inside and the
outside: every process of the job on its node (slurmstepd's batch and step daemons, srun, the
ranks) is SIGKILLed at once, so that none of them reports anything, and the node is set DOWN, which
is what slurmctld does itself once the node's slurmd stops answering (SlurmdTimeout, 300 s by
default). Slurm then requeues the job under the same id; the batch script runs again from the top,
resumes from SAVE_DIR/latest and finishes with final weights and optimizer state equal, bit for
bit, to those of the same job never interrupted.

Skipped with a reason where no Slurm controller answers, unless MEGAZERO_REQUIRE_SLURM=1 (see
test_sbatch.py; ci/slurm/setup.sh starts one, .ci/run does it in CI)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time

import pytest

from tests.faults.elastic_runs import differing_tensors, directory_bytes, fault_seed
from tests.slurm.launchers import TINY_FLAGS
from tests.slurm.test_sbatch import TERMINAL, _why_not, recipe_env, submit  # noqa: F401 (submit: a fixture)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_why_not is not None, reason=f"{_why_not}; start one with ci/slurm/setup.sh")]

ITERS = 20
# the README's tiny model with dropout on, a progress line every iteration and a checkpoint every 2
FLAGS = (*TINY_FLAGS["pretrain_gpt2.sbatch"], "--dropout", "0.1", "--log-interval", "1", "--save-interval", "2",
         "--sample-tokens", "4", "--peak-flops", "1e11")
CHECKPOINT_FILES = ("mp_rank_00_model_states.pt", "mp_rank_00_optim_states.pt")
HEADER = re.compile(r"^job (\d+): .* requeued (\d+) time\(s\)$", re.MULTILINE)
ITERATION = re.compile(r"^ iteration +(\d+)/", re.MULTILINE)
RESUMED = re.compile(r"resumed from \S+ at iteration (\d+)")


def _attempts(log: str) -> list[str]:
    """The log split into the batch script's runs, each from its launcher header line on."""
    starts = [m.start() for m in HEADER.finditer(log)]
    return [log[a:b] for a, b in zip(starts, [*starts[1:], len(log)])] or [""]


def job_processes(job_id: str) -> list[int]:
    """Pids of the job's slurmstepd daemons ("slurmstepd: [ID.batch]", "[ID.0]", ...) and of every
    process started for it (SLURM_JOB_ID=ID in the environment), the daemons first."""
    daemons, others = [], []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ")
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if cmdline.startswith(f"slurmstepd: [{job_id}.".encode()):
            daemons.append(int(entry))
        elif f"SLURM_JOB_ID={job_id}".encode() in environ:
            others.append(int(entry))
    return daemons + others


def fail_node(job_id: str, node: str) -> list[int]:
    """SIGKILL every process of the job (one node: all of them), then set its node DOWN; the pids."""
    pids = job_processes(job_id)
    assert pids, f"no process of job {job_id} found"
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DOWN",
                    "Reason=megazero test: simulated node failure"], check=True)
    return pids


def node_state(node: str) -> str:
    out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True).stdout
    match = re.search(r"\bState=(\S+)", out)
    return match.group(1) if match else ""


def test_node_failure_requeues_the_job_and_it_resumes_bit_exact(tmp_path, submit):  # noqa: F811 (the fixture)
    seed = fault_seed()
    step = random.Random(seed).randrange(4, ITERS - 2)
    what = f"seed {seed}: node failure after iteration {step} of {ITERS}"
    print(what, flush=True)
    straight = submit("pretrain_gpt2.sbatch", FLAGS, recipe_env(tmp_path / "straight", TRAIN_ITERS=str(ITERS)))
    job = submit("pretrain_gpt2.sbatch", FLAGS, recipe_env(tmp_path / "killed", TRAIN_ITERS=str(ITERS)))
    save_dir = tmp_path / "killed" / "ckpt"
    deadline = time.time() + 300
    while not re.search(rf"^ iteration +{step}/", job.log(), flags=re.MULTILINE):
        assert time.time() < deadline and job.fields().get("JobState") not in TERMINAL, f"{what}\n{job.log()[-3000:]}"
        time.sleep(0.2)
    node = job.fields()["BatchHost"]
    try:
        killed_at = time.time()
        fail_node(job.id, node)
        requeued_at = resumed_at = None
        while resumed_at is None and job.fields().get("JobState") not in TERMINAL:
            if requeued_at is None and job.fields().get("Restarts") == "1":
                requeued_at = time.time()
            if RESUMED.search(_attempts(job.log())[-1]) and len(_attempts(job.log())) > 1:
                resumed_at = time.time()
            assert time.time() < killed_at + 600, f"{what}: not resumed within 600 s\n{job.log()[-3000:]}"
            time.sleep(0.5)
    finally:
        if node_state(node).startswith("DOWN"):  # ReturnToService=2 usually brings it back by itself
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
    log = job.assert_completed()
    straight.assert_completed()

    fields = job.fields()
    attempts = _attempts(log)
    assert fields["Restarts"] == "1" and len(attempts) == 2, f"{what}: {fields}\n{log[-4000:]}"
    assert [HEADER.search(text).group(2) for text in attempts] == ["0", "1"], f"{what}\n{log[-4000:]}"
    assert requeued_at is not None and resumed_at is not None, f"{what}\n{log[-4000:]}"
    last_done = max(int(i) for i in ITERATION.findall(attempts[0]))
    resumed = int(RESUMED.search(attempts[1]).group(1))
    assert f"resuming from {save_dir}/global_step{resumed}\n" in log, f"{what}\n{log[-4000:]}"
    assert last_done - 2 <= resumed <= last_done, f"{what}: resumed at {resumed}, last done {last_done}"
    assert f"iteration     {ITERS}/{ITERS}" in attempts[1], f"{what}\n{attempts[1][-3000:]}"
    assert (save_dir / "latest").read_text().strip() == f"global_step{ITERS}"
    for name in CHECKPOINT_FILES:
        differing = differing_tensors(str(tmp_path / "straight" / "ckpt" / f"global_step{ITERS}" / name),
                                      str(save_dir / f"global_step{ITERS}" / name))
        assert not differing, f"{what}: {name} differs from the uninterrupted job's in {differing[:10]}"
    print(f"{what}: survived on {fields['NodeList']}; resumed from global_step{resumed} ({last_done - resumed} "
          f"iteration(s) redone, checkpoint size {directory_bytes(str(save_dir / f'global_step{resumed}'))} bytes); "
          f"kill -> requeued {requeued_at - killed_at:.1f} s, kill -> resumed {resumed_at - killed_at:.1f} s",
          flush=True)
