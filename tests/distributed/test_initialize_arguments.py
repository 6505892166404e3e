"""initialize() arguments that overlap the config say which one wins (DeepSpeed's choice) instead
of dropping the other silently: a passed lr_scheduler over the config's `scheduler`, a built
optimizer's param groups over model_parameters."""

from __future__ import annotations

import warnings

import pytest
import torch

import megazero
from megazero.optim.lr_schedules import WarmupLR
from models.gpt import GPT, GPTConfig
from tests.training_helpers import TINY, base_config


def _initialize(pass_scheduler: bool, config_scheduler: bool, model_parameters: str | None) -> dict:
    """initialize() with a built AdamW over all parameters; returns the warnings and what won."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = base_config()
    config.pop("optimizer")
    if not config_scheduler:
        config.pop("scheduler")
    given = {"all": list(model.parameters()), "some": list(model.blocks.parameters()),
             "groups": [{"params": list(model.parameters()), "weight_decay": 0.5}], None: None}[model_parameters]
    scheduler = (lambda opt: WarmupLR(opt, warmup_max_lr=0.5, warmup_num_steps=2)) if pass_scheduler else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, optimizer, _, lr_scheduler = megazero.initialize(model=model, optimizer=optimizer, config=config,
                                                                 model_parameters=given, lr_scheduler=scheduler)
    return {"warnings": [str(w.message) for w in caught if "initialize(" in str(w.message)],
            "max_lr": getattr(lr_scheduler, "max_lrs", [None])[0],
            "trained": sum(p.numel() for g in optimizer.param_groups for p in g["params"]),
            "weight_decay": optimizer.param_groups[0]["weight_decay"]}


def test_passed_scheduler_wins_over_the_config_block_with_a_warning(pools):
    result = pools(1).run(_initialize, True, True, None)[0]
    assert result["max_lr"] == 0.5  # the passed one, as DeepSpeed >= 0.9 does
    assert len(result["warnings"]) == 1
    message = result["warnings"][0]
    assert "lr_scheduler" in message and "'scheduler' block (WarmupLR) is ignored" in message


def test_scheduler_from_one_place_only_is_silent(pools):
    assert pools(1).run(_initialize, True, False, None)[0]["warnings"] == []
    result = pools(1).run(_initialize, False, True, None)[0]
    assert result["warnings"] == [] and result["max_lr"] == 3e-3  # the config's block


@pytest.mark.parametrize("given, detail", [("some", "model_parameters named"), ("groups", "with group options")])
def test_model_parameters_beside_a_built_optimizer_is_ignored_with_a_warning(pools, given, detail):
    result = pools(1).run(_initialize, False, True, given)[0]
    assert len(result["warnings"]) == 1
    message = result["warnings"][0]
    assert "model_parameters=...) is ignored" in message and "AdamW" in message and detail in message
    model_size = sum(p.numel() for p in GPT(GPTConfig(**TINY)).parameters())
    assert result["trained"] == model_size and result["weight_decay"] == 0.01  # the optimizer's own groups


def test_model_parameters_naming_the_optimizers_parameters_is_silent(pools):
    assert pools(1).run(_initialize, False, True, "all")[0]["warnings"] == []
