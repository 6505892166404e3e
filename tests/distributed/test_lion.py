"""Lion through the engine (dropout on): every ZeRO stage on 2 gloo ranks matches the single-process
run, and fp16 trains: Lion takes no grad scale, so the engine unscales and clips its gradients."""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.test_data_parallel import LOSS_RTOL, PARAM_ATOL, _zero
from tests.precision_bounds import warmup_lr_sum
from tests.training_helpers import base_config, build_engine, full_parameters, global_mean

STEPS = 10
LR = 1e-3  # the paper: 3-10x below AdamW's (base_config's 3e-3), decay that much above (0.1)
WARMUP = 3


def _config(**extra) -> dict:
    return base_config(optimizer={"type": "Lion", "params": {"lr": LR, "betas": [0.9, 0.99], "weight_decay": 0.1}},
                       scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": LR, "warmup_num_steps": WARMUP,
                                                                 "warmup_type": "linear"}}, **extra)


def _train_lion(config: dict, prefix: str) -> dict:
    """train() of tests.training_helpers, plus what the engine asked of Lion and the norm of this
    rank's momentum (its ZeRO partition)."""
    engine, loader = build_engine(config, prefix)
    data = iter(loader)
    losses = [global_mean(engine.train_batch(data).item(), engine) for _ in range(STEPS)]
    momentum = math.sqrt(sum(float(s["exp_avg"].double().pow(2).sum()) for s in engine.optimizer.state.values()))
    return {"losses": losses, "params": full_parameters(engine), "skipped": engine.skipped_steps,
            "unscales": engine._optimizer_unscales, "momentum": momentum, "scale": engine.get_loss_scale()}


@pytest.fixture(scope="module")
def single_process(pools, token_dataset_prefix_module) -> dict:
    """One process, micro-batches of 4, two per step: the micro-batches (and dropout streams) that
    2 ranks run with micro-batches of 4."""
    config = _config(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    return pools(1).run(_train_lion, config, token_dataset_prefix_module)[0]


def _assert_weights_match(ref: dict, other: dict) -> None:
    """Within PARAM_ATOL, except the attention's key bias: its exact gradient is zero (softmax
    cancels it), so what it gets is each layout's rounding noise, and Lion takes the sign of that
    noise, a step of lr either way (tests/precision_bounds.py): two runs differ by <= 2 sum lr."""
    bound = 2 * warmup_lr_sum(LR, WARMUP, STEPS) + PARAM_ATOL
    for name, p in ref["params"].items():
        diff = (other["params"][name] - p).abs()
        if name.endswith("attn.qkv.bias"):
            q, k, v = diff.chunk(3)
            assert float(k.max()) <= bound, (name, float(k.max()), bound)
            diff = torch.cat([q, v])
        assert float(diff.max()) <= PARAM_ATOL, (name, float(diff.max()))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lion_under_zero_matches_single_process(pools, single_process, token_dataset_prefix_module, stage):
    results = pools(2).run(_train_lion, _config(zero_optimization=_zero(stage)), token_dataset_prefix_module)
    for result in results:
        for step, (a, b) in enumerate(zip(single_process["losses"], result["losses"])):
            assert abs(a - b) <= LOSS_RTOL * abs(a), f"stage {stage} step {step}: loss {a} vs {b}"
        _assert_weights_match(single_process, result)
    assert single_process["losses"][-1] < single_process["losses"][0] - 0.3  # and it learns


@pytest.mark.parametrize("stage", [0, 3])
def test_lion_fp16_is_unscaled_by_the_engine(pools, token_dataset_prefix_module, stage):
    """fp16 with a loss scale of 2^12 tracks fp32 (losses within 2%), and Lion's momentum is the
    unscaled, clipped gradients' (an unscaled momentum would be 4096x the fp32 one)."""
    fp32 = pools(2).run(_train_lion, _config(zero_optimization=_zero(stage)), token_dataset_prefix_module)
    fp16 = pools(2).run(_train_lion, _config(zero_optimization=_zero(stage),
                                             fp16={"enabled": True, "initial_scale_power": 12}),
                        token_dataset_prefix_module)
    for ref, half in zip(fp32, fp16):
        assert half["unscales"] is False and half["skipped"] == 0 and half["scale"] == 4096.0
        for a, b in zip(ref["losses"], half["losses"]):
            assert abs(a - b) <= 0.02 * a, (ref["losses"], half["losses"])
        assert half["losses"][-1] < half["losses"][0] - 0.3
        assert abs(half["momentum"] / ref["momentum"] - 1) < 0.05, (half["momentum"], ref["momentum"])
