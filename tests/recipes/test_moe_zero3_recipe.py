"""The MoE GPT recipe (configs/gpt2_moe_cpu.json, 4 experts, top-2) at EP=2 and
zero_optimization.stage 3 on 2 gloo ranks logs the losses of 1 rank at stage 0 (whose micro-batch
holds the EP group's samples, as the auxiliary losses need: docs/parallelism.md), with dropout 0.1
on layout-invariant masks (an engine JSON with dropout_masks.layout_invariant); its checkpoint
continues on 1 rank at stage 0 exactly as the 1-rank checkpoint does, and generates text."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from tests.conftest import REPO
from tests.launch_helpers import finish, start, torchrun
from tests.recipes.test_pretrain_gpt import _scalars

pytestmark = pytest.mark.slow

SHAPE = ("--model-config", os.path.join(REPO, "configs", "gpt2_moe_cpu.json"), "--num-layers", "2",
         "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--global-batch-size", "8",
         "--micro-batch-size", "4", "--lr", "0.005", "--log-interval", "1", "--eval-interval", "100",
         "--eval-iters", "1", "--peak-flops", "1e11", "--sample-tokens", "0", "--dropout", "0.1")


def _engine_json(tmp_path, stage: int) -> str:
    """The recipe's engine JSON at ZeRO `stage`, every layout drawing the same dropout masks."""
    path = tmp_path / f"engine_stage{stage}.json"
    with open(os.path.join(REPO, "configs", "ds_gpt2_cpu.json")) as f:
        config = json.load(f)
    config["zero_optimization"]["stage"] = stage
    path.write_text(json.dumps({**config, "dropout_masks": {"layout_invariant": True}}))
    return str(path)


def _gpt(tmp_path, name: str, stage: int, nproc: int, *flags: str):
    """The GPT recipe on `nproc` ranks, started (TensorBoard events in tmp_path/tb_<name>)."""
    return start(torchrun("pretrain_gpt.py", "--data-path", os.path.join(REPO, "data", "gpt2", "shakespeare"),
                          *SHAPE, "--tensorboard-dir", str(tmp_path / f"tb_{name}"), "--deepspeed_config",
                          _engine_json(tmp_path, stage), *flags, nproc=nproc), tmp_path)


def _losses(tmp_path, name: str) -> list[float]:
    return [value for _, value in _scalars(str(tmp_path / f"tb_{name}"))["lm loss"]]


def test_moe_recipe_at_ep2_zero3_logs_the_one_rank_losses_and_continues_on_one_rank(corpus_prefix, tmp_path):
    # one rank runs the EP group's samples (2 ranks x 4) as one micro-batch: the auxiliary losses cover them together
    one, ep2 = finish(_gpt(tmp_path, "one", 0, 1, "--train-iters", "4", "--micro-batch-size", "8", "--save",
                           str(tmp_path / "one"), "--save-interval", "4"),
                      _gpt(tmp_path, "ep2", 3, 2, "--expert-model-parallel-size", "2", "--train-iters", "4",
                           "--save", str(tmp_path / "ep2"), "--save-interval", "4"))
    assert re.search(r"^GPT: .* DP 2 \(EP 2\), .*, ZeRO-3$", ep2, re.MULTILINE), ep2[:3000]
    reference = _losses(tmp_path, "one")
    assert len(reference) == 4
    assert _losses(tmp_path, "ep2") == pytest.approx(reference, rel=1e-5)
    # both checkpoints continue on 1 rank at stage 0 with the same next losses; the EP=2 ZeRO-3 one generates
    generate = start([sys.executable, os.path.join(REPO, "scripts", "generate.py"), "--load", str(tmp_path / "ep2"),
                      "--prompt", "ROMEO:", "--max-new-tokens", "4"], tmp_path)
    *resumed, generated = finish(*(_gpt(tmp_path, f"resume_{name}", 0, 1, "--train-iters", "6",
                                        "--micro-batch-size", "8", "--load", str(tmp_path / name))
                                   for name in ("one", "ep2")), generate)
    for out in resumed:
        assert "resumed from" in out, out
    assert "ROMEO:" in generated, generated[-2000:]
    assert _losses(tmp_path, "resume_ep2") == pytest.approx(_losses(tmp_path, "resume_one"), rel=1e-5)
