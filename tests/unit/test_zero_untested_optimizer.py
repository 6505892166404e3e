"""zero_allow_untested_optimizer: at ZeRO stages 1-3 an optimizer megazero does not build is refused
unless the config allows it (then a warning), as in DeepSpeed; stage 0 takes any optimizer."""

from __future__ import annotations

import pytest
import torch

from megazero.config import parse_config
from megazero.zero.optimizer_check import check_zero_optimizer


def _config(stage: int, allow: bool = False):
    return parse_config({"train_batch_size": 8, "zero_optimization": {"stage": stage},
                         "zero_allow_untested_optimizer": allow}, 1)


def _rmsprop():
    return torch.optim.RMSprop([torch.nn.Parameter(torch.zeros(3))])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_untested_optimizer_is_refused_under_zero(stage):
    match = f"RMSprop is untested with ZeRO stage {stage}.*'zero_allow_untested_optimizer'"
    with pytest.raises(ValueError, match=match):
        check_zero_optimizer(_config(stage), _rmsprop())


def test_the_key_allows_it_with_a_warning():
    with pytest.warns(UserWarning, match="untested optimizer RMSprop"):
        check_zero_optimizer(_config(2, allow=True), _rmsprop())


def test_stage_0_and_the_optimizers_megazero_builds_need_nothing():
    check_zero_optimizer(_config(0), _rmsprop())
    check_zero_optimizer(_config(2), torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))]))
