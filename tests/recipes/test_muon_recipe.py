"""The GPT recipe with `--optimizer muon` (Muon on the hidden matrices, AdamW on the rest, the
reference's bf16 Newton-Schulz) on 2 gloo ranks at ZeRO-1 and ZeRO-3 logs the losses of 1 rank taking
the same global batch, dropout 0.1 on layout-invariant masks (an engine JSON setting the stage).
Every stage 0-3 through the engine is tests/distributed/test_muon.py's."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import REPO
from tests.launch_helpers import finish, start, torchrun
from tests.recipes.test_pretrain_gpt import _scalars
from tests.recipes.test_run_config_recipe import SHAPE

pytestmark = pytest.mark.slow

ITERS = 5
STAGES = (1, 3)  # a partitioned optimizer state, and partitioned parameters too


def _engine(tmp_path, stage: int) -> str:
    with open(os.path.join(REPO, "configs", "ds_gpt2_cpu.json")) as f:
        config = json.load(f)
    config["zero_optimization"] = {**config["zero_optimization"], "stage": stage,
                                   "stage3_param_persistence_threshold": 0}
    path = tmp_path / f"engine_zero{stage}.json"
    path.write_text(json.dumps({**config, "dropout_masks": {"layout_invariant": True}}))
    return str(path)


def test_muon_recipe_at_zero_1_and_3_logs_the_single_rank_losses(corpus_prefix, tmp_path):
    runs = {"single": (1, 0), **{f"zero{stage}": (2, stage) for stage in STAGES}}
    outputs = dict(zip(runs, finish(*(
        start(torchrun("pretrain_gpt.py", "--data-path", corpus_prefix, *SHAPE, "--train-iters", str(ITERS),
                       "--optimizer", "muon", "--lr", "0.02", "--deepspeed_config", _engine(tmp_path, stage),
                       "--tensorboard-dir", str(tmp_path / name), nproc=nproc), tmp_path)
        for name, (nproc, stage) in runs.items()))))
    assert "optimizer.type = \"Muon\" from --optimizer" in outputs["single"], outputs["single"][-3000:]
    reference = [value for _, value in _scalars(str(tmp_path / "single"))["lm loss"]]
    assert len(reference) == ITERS and reference[-1] < reference[0]
    for stage in STAGES:
        losses = [value for _, value in _scalars(str(tmp_path / f"zero{stage}"))["lm loss"]]
        assert losses == pytest.approx(reference, rel=1e-4), (stage, losses, reference)
