"""The Llama recipe as `make pretrain-llama` runs it (bash scripts/pretrain_llama.sh, torchrun on 2
gloo ranks, the real corpus): GPT's console lines, TensorBoard scalars, checkpoints and resume,
with its own flags; tiny and short (the GPT recipe's tests cover the loop at length)."""

from __future__ import annotations

import os
import re

import pytest

from tests.conftest import REPO
from tests.recipes.test_pretrain_gpt import _scalars
from tests.slurm.launchers import TINY_FLAGS, losses, run_in_own_session, user_env

pytestmark = pytest.mark.slow

# TP=2 with one key/value head (replicated over the two ranks), then resumed at DP=2
FLAGS = (*TINY_FLAGS["pretrain_llama.sh"], "--num-query-groups", "1", "--rope-theta", "5000",
         "--log-interval", "5", "--eval-interval", "10", "--save-interval", "10", "--peak-flops", "1e11",
         "--sample-tokens", "20")


def _launch(tmp_path, *extra: str) -> str:
    env = user_env({"NPROC": "2", "SAVE_DIR": str(tmp_path / "ckpt"), "TB_DIR": str(tmp_path / "tb")},
                   outside_slurm=True)
    proc = run_in_own_session(["bash", "scripts/pretrain_llama.sh", *FLAGS, *extra], env, REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_pretrain_llama_trains_logs_saves_and_resumes(corpus_prefix, tmp_path):
    out = _launch(tmp_path, "--tensor-model-parallel-size", "2", "--train-iters", "20")
    assert re.search(r"Llama: [0-9,]+ parameters, 2 ranks = TP 2 x PP 1 x DP 1, .*1 key/value groups for 4 heads",
                     out), out
    trained = losses(out)
    assert len(trained) == 4 and trained[-1] < trained[0], out
    assert len(re.findall(r"validation at iteration (?:10|20) \| lm loss: [0-9.]+ \| lm loss PPL", out)) == 2, out
    assert "tokens/s:" in out and "MFU:" in out and "----- sample -----" in out
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["global_step10", "global_step20", "latest"]
    scalars = _scalars(str(tmp_path / "tb"))
    for tag in ("lm loss", "learning-rate", "grad-norm", "throughput/tokens-per-sec", "lm loss validation"):
        assert tag in scalars, f"missing TensorBoard scalar {tag!r}; have {sorted(scalars)}"
    assert [step for step, _ in scalars["lm loss"]] == [5, 10, 15, 20]

    resumed = _launch(tmp_path, "--train-iters", "25")
    assert "TP 1 x PP 1 x DP 2" in resumed and "at iteration 20" in resumed and "iteration     25/25" in resumed
    assert losses(resumed)[0] < trained[0]
    assert "global_step25" in os.listdir(tmp_path / "ckpt")
