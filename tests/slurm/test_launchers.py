"""The launchers in scripts/ outside Slurm (`bash scripts/<launcher> [flags]`, as the README writes
it), and what a fresh clone needs for `sbatch scripts/<launcher>` to start at all."""

from __future__ import annotations

import glob
import os
import subprocess

import pytest

from tests.conftest import REPO
from tests.slurm.launchers import (
    DATA_LAUNCHERS,
    LAUNCHERS,
    SMALL_VOCAB,
    TINY_FLAGS,
    dataset_files,
    ensure_data,
    header_output_paths,
    losses,
    one_preprocess_run,
    run_in_own_session,
    small_corpus,
    user_env,
)


def test_every_launcher_is_tested():
    found = {os.path.basename(p) for pattern in ("*.sh", "*.sbatch") for p in glob.glob(f"{REPO}/scripts/{pattern}")}
    known = sorted(LAUNCHERS + DATA_LAUNCHERS)
    assert found == set(known), f"scripts/ has launchers {sorted(found)}; the tests know {known}"


@pytest.mark.parametrize("launcher", LAUNCHERS + DATA_LAUNCHERS)
def test_directories_the_sbatch_headers_write_to_are_in_git(launcher):
    # Slurm does not create the directory of --output: a job whose log directory is missing on a
    # fresh clone fails with JobLaunchFailure before the script runs
    for path in header_output_paths(launcher):
        directory = os.path.dirname(path)
        if not directory or os.path.isabs(directory):
            continue
        tracked = subprocess.run(["git", "-C", REPO, "ls-files", "--", directory], capture_output=True, text=True,
                                 check=True).stdout
        assert tracked.strip(), f"scripts/{launcher} writes its log to {path}, but {directory}/ is not in git"


@pytest.mark.slow
@pytest.mark.parametrize("launcher,from_repo_root", [("pretrain_gpt2.sh", True), ("pretrain_bert.sh", True),
                                                     ("pretrain_gpt2.sbatch", False)])
def test_bash_runs_the_launcher_on_this_machine(tmp_path, launcher, from_repo_root):
    ensure_data(launcher)
    script = f"scripts/{launcher}" if from_repo_root else os.path.join(REPO, "scripts", launcher)
    env = user_env({"NPROC": "2", "SAVE_DIR": str(tmp_path / "ckpt"), "TB_DIR": str(tmp_path / "tb")},
                   outside_slurm=True)
    proc = run_in_own_session(["bash", script, *TINY_FLAGS[launcher], "--train-iters", "10"], env,
                              REPO if from_repo_root else str(tmp_path), timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "launcher torchrun --standalone, 2 process(es)" in out and "2 ranks" in out, out
    assert "iteration     10/10" in out and len(losses(out)) == 2, out
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step10"


def test_bash_runs_the_data_launcher_on_this_machine(tmp_path):
    # outside Slurm: one process over all the inputs, trains the tokenizer, writes what one
    # preprocess_data.py run writes with it
    inputs = small_corpus(tmp_path / "corpus")
    prefix = str(tmp_path / "out" / "corpus")
    env = user_env({"INPUT": " ".join(inputs), "OUTPUT_PREFIX": prefix, "VOCAB_SIZE": SMALL_VOCAB}, outside_slurm=True)
    proc = run_in_own_session(["bash", "scripts/preprocess_data.sbatch"], env, REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = dataset_files(prefix)
    assert set(written) == {"_train_text_document.bin", "_train_text_document.idx", "_valid_text_document.bin",
                            "_valid_text_document.idx", "_stats.json"}, sorted(written)
    assert written == one_preprocess_run(inputs, str(tmp_path / "one" / "corpus"), prefix + "_tokenizer.model")
    assert sorted(os.listdir(tmp_path / "out")) == sorted(f"corpus{suffix}" for suffix in
                                                          [*written, "_tokenizer.model", "_tokenizer.vocab"])


@pytest.mark.parametrize("devices,cores,nproc,threads", [(0, 1, 1, "1"), (0, 2, 2, "1"), (0, 16, 2, "8"),
                                                         (1, 16, 1, None), (8, 64, 2, None)])
def test_default_nproc_fits_the_recipes_batch(tmp_path, devices, cores, nproc, threads):
    # the recipes' configs (a global batch of two micro-batches) fit at most 2 data-parallel ranks: the
    # default NPROC is the GPUs or cores up to 2, the remaining CPU cores becoming threads. A stand-in
    # PYTHON reports the machine and prints the torchrun command it is handed.
    fake = tmp_path / "python"
    fake.write_text(f"#!/usr/bin/env bash\nif [ \"$1\" = -c ]; then echo {devices} {cores}; exit 0; fi\n"
                    "echo \"ARGS $* OMP=${OMP_NUM_THREADS:-unset}\"\n")
    fake.chmod(0o755)
    env = user_env({"PYTHON": str(fake)}, outside_slurm=True)
    out = subprocess.run(["bash", "-c", "source scripts/launch_lib.bash; megazero_launch scripts/pretrain_gpt.py"],
                         cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    assert f"--nproc_per_node={nproc} " in out, out
    assert f"OMP={threads or '1'}" in out, out
