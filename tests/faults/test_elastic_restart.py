"""Issue 14, item 2: a rank of a 2-rank run of `scripts/pretrain_gpt2.sh` (torchrun, dropout on) is
killed with SIGKILL; with MAX_RESTARTS=1 torchrun starts both workers again with the same command,
they resume from `latest` of SAVE_DIR (the launcher's --save and --load), and the run finishes with
final weights and optimizer state equal, bit for bit, to those of a run that was never interrupted.

Where and whom to kill is drawn from a seeded generator (printed; MEGAZERO_FAULT_SEED replays it):
after a random iteration's progress line, or while a random checkpoint is being written (its
temporary directory has appeared and `latest` does not name it yet)."""

from __future__ import annotations

import os
import random
import re
import time

import pytest

from tests.conftest import REPO, repo_pythonpath
from tests.faults.elastic_runs import (
    ELASTIC_FLAGS,
    ITERATION,
    RESUMED,
    LauncherRun,
    differing_tensors,
    directory_bytes,
    fault_seed,
    iterations_printed,
)
from tests.slurm.launchers import ensure_data, run_in_own_session, user_env

pytestmark = pytest.mark.slow

ITERS = 12
SAVE_INTERVAL = 2
FINAL = f"global_step{ITERS}"
CHECKPOINT_FILES = ("mp_rank_00_model_states.pt", "mp_rank_00_optim_states.pt")


def _launch(tmp_path, name: str, max_restarts: int) -> tuple[LauncherRun, str]:
    """`bash scripts/pretrain_gpt2.sh` from the repository root, 2 processes, SAVE_DIR in tmp_path."""
    ensure_data("pretrain_gpt2.sh")
    save_dir = str(tmp_path / f"ckpt_{name}")
    env = user_env({"NPROC": "2", "MAX_RESTARTS": str(max_restarts), "SAVE_DIR": save_dir,
                    "TB_DIR": str(tmp_path / f"tb_{name}")}, outside_slurm=True)
    run = LauncherRun(["bash", "scripts/pretrain_gpt2.sh", *ELASTIC_FLAGS, "--train-iters", str(ITERS)], env)
    return run, save_dir


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    """The final checkpoint directory of the same run, never killed."""
    run, save_dir = _launch(tmp_path_factory.mktemp("uninterrupted"), "straight", 0)
    assert run.finish() == 0, run.output()[-4000:]
    assert open(os.path.join(save_dir, "latest")).read().strip() == FINAL
    return os.path.join(save_dir, FINAL)


def _kill_during_save(run: LauncherRun, save_dir: str, tag: str, rank: int) -> float:
    """SIGKILL `rank` as soon as the temporary directory of checkpoint `tag` appears (polled every
    millisecond); the time it was sent."""
    run.wait_for(re.compile(rf"^ iteration +{int(tag.removeprefix('global_step')) - 1}/"))
    pids = run.worker_pids()  # found before the save starts, so that the kill lands inside it
    partial = os.path.join(save_dir, f".{tag}.tmp")
    deadline = time.time() + 120
    while not os.path.isdir(partial):
        assert time.time() < deadline and run.proc.poll() is None, f"no {partial} appeared:\n{run.output()[-3000:]}"
        time.sleep(0.001)
    return run.kill_rank(rank, pids)


@pytest.mark.parametrize("when", ["after-iteration", "during-save"])
def test_sigkill_of_one_rank_is_restarted_and_resumes_bit_exact(tmp_path, uninterrupted, when):
    seed = fault_seed()
    rng = random.Random(seed)
    victim = rng.randrange(2)
    run, save_dir = _launch(tmp_path, "killed", 1)
    if when == "after-iteration":
        # after the line of an iteration past the first save: the save of iteration 2 runs after
        # its progress line, so a kill right after that line could come before any `latest`
        step = rng.randrange(SAVE_INTERVAL + 1, ITERS - 1)
        what = f"seed {seed}: SIGKILL rank {victim} after iteration {step} of {ITERS}"
        print(what, flush=True)
        run.wait_for(re.compile(rf"^ iteration +{step}/"))
        killed_at = run.kill_rank(victim)
    else:
        step = rng.randrange(2 * SAVE_INTERVAL, ITERS, SAVE_INTERVAL)
        what = f"seed {seed}: SIGKILL rank {victim} while global_step{step} is being saved"
        print(what, flush=True)
        killed_at = _kill_during_save(run, save_dir, f"global_step{step}", victim)
    latest_at_kill = open(os.path.join(save_dir, "latest")).read().strip()
    if when == "during-save":
        assert latest_at_kill == f"global_step{step - SAVE_INTERVAL}", f"{what}: the kill came after the save"

    resumed_at, match = run.wait_for(RESUMED, after=killed_at)
    partial_bytes = sum(directory_bytes(os.path.join(save_dir, d)) for d in os.listdir(save_dir) if d.endswith(".tmp"))
    training_at, _ = run.wait_for(ITERATION, after=resumed_at)
    status = run.finish()
    out = run.output()
    assert status == 0, f"{what}\n{out[-5000:]}"
    assert f"iteration     {ITERS}/{ITERS}" in out, f"{what}\n{out[-3000:]}"
    assert out.count("resumed from") == 1, f"{what}: expected one restart\n{out[-5000:]}"

    # the restart loads the last complete checkpoint: the one `latest` named when the run was killed,
    # or the one being published then (rank 0 may finish a save its peer had written its part of)
    resumed = int(match.group(2))
    before = iterations_printed(run.lines, resumed_at)
    last_done = max(before)
    assert match.group(1) == os.path.join(save_dir, f"global_step{resumed}"), f"{what}: {match.group(0)}"
    assert f"global_step{resumed}" in (latest_at_kill, f"global_step{last_done - last_done % SAVE_INTERVAL}"), (
        f"{what}: resumed from global_step{resumed}; `latest` named {latest_at_kill} at the kill and iteration "
        f"{last_done} was the last one done")
    assert last_done - SAVE_INTERVAL <= resumed <= last_done, f"{what}: resumed at {resumed}, last done {last_done}"

    for name in CHECKPOINT_FILES:
        differing = differing_tensors(os.path.join(uninterrupted, name), os.path.join(save_dir, FINAL, name))
        assert not differing, f"{what}: {name} differs from the uninterrupted run's in {differing[:10]}"
    print(f"{what}: survived; resumed from global_step{resumed} ({last_done - resumed} iteration(s) redone, "
          f"{partial_bytes} bytes of unpublished checkpoint discarded, checkpoint size "
          f"{directory_bytes(os.path.join(save_dir, FINAL))} bytes); kill -> resumed {resumed_at - killed_at:.1f} s, "
          f"kill -> first iteration {training_at - killed_at:.1f} s", flush=True)


# attempt 0: both ranks meet, then rank 1 dies; attempt 1: rank 1 is slow to start, so rank 0 looks up
# rank 1's address before the new rank 1 has written it. With one store for every attempt it finds
# the dead rank's and cannot connect; with a store per attempt it waits for the new one.
RESTART_PROBE = """
import os, signal, time
import torch.distributed as dist
import megazero
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 1:
    time.sleep(2)
megazero.init_distributed(timeout=60)
dist.barrier()
if attempt == 0 and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
print(f"attempt {attempt} rank {rank} connected", flush=True)
dist.destroy_process_group()
"""


def test_launcher_restarts_meet_in_a_fresh_store(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(RESTART_PROBE)
    env = user_env({"NPROC": "2", "MAX_RESTARTS": "1", "PYTHONPATH": repo_pythonpath()}, outside_slurm=True)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    cmd = ["bash", "-c", f"source scripts/launch_lib.bash && megazero_launch {probe}"]
    proc = run_in_own_session(cmd, env, REPO, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "max restarts 1" in out and "attempt 1 rank 0 connected" in out and "attempt 1 rank 1 connected" in out, (
        out[-4000:])
