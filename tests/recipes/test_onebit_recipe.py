"""The GPT recipe at DP=2 with the shipped 1-bit configs (configs/ds_gpt2_onebit_adam.json,
ds_gpt2_zero_one_adam.json, ds_gpt2_onebit_lamb.json), their warm-up shortened (3 steps; 0/1 Adam:
4 variance updates, then compressed gradients and local steps from step 8): each trains through its
compressed stage with a falling loss, and its first 3 losses are those of its plain counterpart
(Adam or LAMB without bias correction, the same config otherwise), dropout on."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import REPO
from tests.launch_helpers import finish, start, torchrun
from tests.recipes.test_pretrain_gpt import _scalars
from tests.recipes.test_run_config_recipe import SHAPE

pytestmark = pytest.mark.slow

WARMUP = {"OneBitAdam": {"freeze_step": 3}, "OneBitLamb": {"freeze_step": 3},
          "ZeroOneAdam": {"var_freeze_step": 6, "var_update_scaler": 4, "local_step_scaler": 2,
                          "local_step_clipper": 2}}
SHIPPED = {"OneBitAdam": "ds_gpt2_onebit_adam.json", "ZeroOneAdam": "ds_gpt2_zero_one_adam.json",
           "OneBitLamb": "ds_gpt2_onebit_lamb.json"}
PLAIN = {"OneBitAdam": "Adam", "ZeroOneAdam": "Adam", "OneBitLamb": "Lamb"}
ITERS = 10


def _engine_config(tmp_path, optimizer: str, plain: bool) -> str:
    """The shipped config, its warm-up shortened (or its optimizer replaced by the plain one)."""
    with open(f"{REPO}/configs/{SHIPPED[optimizer]}") as f:
        config = json.load(f)
    params = config["optimizer"]["params"]
    if plain:
        keep = {k: params[k] for k in ("lr", "betas", "eps", "weight_decay")}
        config["optimizer"] = {"type": PLAIN[optimizer], "params": {**keep, "bias_correction": False}}
    else:
        params.update(WARMUP[optimizer])
    path = tmp_path / f"{optimizer}{'_plain' if plain else ''}.json"
    path.write_text(json.dumps(config))
    return str(path)


def _both_losses(tmp_path, corpus_prefix, optimizer: str) -> tuple[list[float], list[float]]:
    """The `lm loss` of the 1-bit run and of its plain counterpart, run side by side."""
    names = [optimizer, f"{optimizer}_plain"]
    finish(*(start(torchrun("pretrain_gpt.py", "--data-path", corpus_prefix, *SHAPE, "--train-iters", str(ITERS),
                            "--deepspeed_config", _engine_config(tmp_path, optimizer, plain), "--tensorboard-dir",
                            str(tmp_path / name)), tmp_path)
             for name, plain in zip(names, (False, True))))
    onebit, plain = ([value for _, value in _scalars(str(tmp_path / name))["lm loss"]] for name in names)
    return onebit, plain


@pytest.mark.parametrize("optimizer", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_the_recipe_trains_with_the_one_bit_configs_and_warms_up_as_the_plain_optimizer(corpus_prefix, tmp_path,
                                                                                       optimizer):
    onebit, plain = _both_losses(tmp_path, corpus_prefix, optimizer)
    assert len(onebit) == ITERS and all(math.isfinite(v) for v in onebit)
    assert onebit[:3] == plain[:3]
    assert onebit[3:] != plain[3:]  # the compressed stage is not the plain optimizer
    assert onebit[-1] < onebit[0]
