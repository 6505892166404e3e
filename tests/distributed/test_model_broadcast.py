"""Every data-parallel rank starts from data-parallel rank 0's model, as in DeepSpeed, even when the
ranks built different weights (torch seeds each process differently)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megazero
from megazero.zero import GatheredParameters, Init
from models.gpt import GPT, GPTConfig
from tests.training_helpers import TINY, base_config


def _checksums(model: torch.nn.Module) -> list[float]:
    return [p.double().sum().item() for p in model.parameters()]


def _build_apart_and_train(stage: int, under_init: bool) -> dict:
    megazero.set_seed(1 + dist.get_rank())  # each rank builds other weights
    if under_init:
        with Init():
            model = GPT(GPTConfig(**TINY))
    else:
        model = GPT(GPTConfig(**TINY))
    built = _checksums(model) if not under_init else None
    engine, _, _, _ = megazero.initialize(model=model, config=base_config(zero_optimization={"stage": stage}))
    with GatheredParameters(list(engine.module.parameters())):
        started = _checksums(engine.module)
    return {"built": built, "started": started}


@pytest.mark.parametrize("stage,under_init", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_every_rank_starts_from_rank_zeros_model(pools, stage, under_init):
    results = pools(2).run(_build_apart_and_train, stage, under_init)
    if not under_init:
        assert results[0]["built"] != results[1]["built"], "the control: the ranks built different weights"
    rank_zeros_model = _seeded_checksums(1)
    for result in results:
        assert result["started"] == rank_zeros_model, "a rank did not start from rank 0's model"


def _seeded_checksums(seed: int) -> list[float]:
    megazero.set_seed(seed)
    return _checksums(GPT(GPTConfig(**TINY)))
