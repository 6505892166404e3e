"""Issue 12 as reported: the GPT recipe under torchrun on 2 ranks with --dropout 0.1 and a WarmupLR
schedule, 8 iterations straight versus 4 iterations, save, and a resume to 8. The losses of
iterations 5-8 (TensorBoard's float32 `lm loss`, logged every iteration) must be equal, not close,
at TP=2 and PP=2 (DP=2's exact resume with dropout is tests/distributed/test_checkpoint.py's, in a
new process group). The first run ends the way a user's run does (validation, checkpoint,
sample), so anything drawing random numbers between the save and the next step would show."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.launch_helpers import finish, start, torchrun
from tests.recipes.test_pretrain_gpt import _scalars

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow

LAYOUTS = {"tp2": ("--tensor-model-parallel-size", "2"), "pp2": ("--pipeline-model-parallel-size", "2")}


def _warmup_lr_config(tmp_path) -> str:
    """The recipe's engine config with the report's WarmupLR schedule (it does not depend on
    --train-iters, so the 4-iteration run is the first half of the 8-iteration one)."""
    with open(os.path.join(REPO, "configs", "ds_gpt2_cpu.json")) as f:
        config = json.load(f)
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                                                          "warmup_num_steps": 25, "warmup_type": "linear"}}
    path = tmp_path / "ds_warmup.json"
    path.write_text(json.dumps(config))
    return str(path)


def _start(corpus_prefix: str, tmp_path, name: str, iters: int, config: str,
           layout: tuple[str, ...]) -> subprocess.Popen:
    ckpt, tb = tmp_path / f"ckpt_{name}", tmp_path / f"tb_{name}"
    return start(torchrun("pretrain_gpt.py", "--deepspeed_config", config, "--data-path", corpus_prefix,
                          "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length",
                          "32", "--dropout", "0.1", "--train-iters", str(iters), "--log-interval", "1",
                          "--eval-interval", "100", "--eval-iters", "1", "--save-interval", "100", "--sample-tokens",
                          "4", "--save", str(ckpt), "--load", str(ckpt), "--tensorboard-dir", str(tb), *layout),
                 tmp_path)


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_resume_with_dropout_continues_the_uninterrupted_losses(corpus_prefix, tmp_path, layout):
    config = _warmup_lr_config(tmp_path)
    # the straight run and the first half side by side (launch start-up leaves the cores idle part of the time)
    finish(_start(corpus_prefix, tmp_path, "straight", 8, config, LAYOUTS[layout]),
           _start(corpus_prefix, tmp_path, "resumed", 4, config, LAYOUTS[layout]))
    finish(_start(corpus_prefix, tmp_path, "resumed", 8, config, LAYOUTS[layout]))
    straight = _scalars(str(tmp_path / "tb_straight"))["lm loss"]
    resumed = _scalars(str(tmp_path / "tb_resumed"))["lm loss"]
    assert [step for step, _ in straight] == list(range(1, 9))
    assert sorted(step for step, _ in resumed) == list(range(1, 9))
    after_resume = {step: loss for step, loss in resumed if step > 4}
    assert [after_resume[step] for step in range(5, 9)] == [loss for step, loss in straight if step > 4], (
        straight, resumed)
