"""Data parallelism (ZeRO stages 0-3) and gradient accumulation match the single-process run, dropout on."""

from __future__ import annotations

import pytest
import torch

from tests.precision_bounds import assert_weights_within_format, warmup_lr_sum
from tests.training_helpers import base_config, build_engine, train

STEPS = 10
# fp32: the only difference between layouts is the order of the gradient summation
LOSS_RTOL = 1e-5
PARAM_ATOL = 2e-5
# bf16: the layouts run different micro-batch sizes through bf16 matmuls (a different blocking, so
# different roundings at bf16's 2^-8 relative precision); the fp32 master weights keep those from
# accumulating, and 10 steps stay within 1% of the single-process bf16 losses; the weights within
# the bound derived from bf16's unit roundoff, the LRs and AdamW (tests/precision_bounds.py)
BF16_LOSS_RTOL = 1e-2


def _assert_same_run(ref: dict, other: dict, loss_rtol: float = LOSS_RTOL, param_atol: float | None = PARAM_ATOL):
    assert len(ref["losses"]) == len(other["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(ref["losses"], other["losses"])):
        assert abs(a - b) <= loss_rtol * abs(a), f"step {step}: loss {a} vs {b}"
    if param_atol is not None:
        for name, p in ref["params"].items():
            torch.testing.assert_close(other["params"][name], p, rtol=0, atol=param_atol, msg=name)
    assert ref["losses"][-1] < ref["losses"][0]


def _single_process(pools, prefix: str):
    """get(micro, **config) -> the single-process run of each global batch of 8 as 8 // micro
    accumulated micro-batches of `micro` (cached). Dropout is on: a data-parallel layout's
    micro-batches of the same size draw the same masks as these (micro-batch i of a step, counted
    micro-step by micro-step and rank by rank, has the same dropout stream at every DP size)."""
    made = {}

    def get(micro: int, **extra) -> dict:
        key = (micro, tuple(sorted(extra)))
        if key not in made:
            config = base_config(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=8 // micro, **extra)
            made[key] = pools(1).run(train, config, prefix, STEPS)[0]
        return made[key]

    return get


@pytest.fixture(scope="module")
def reference(pools, token_dataset_prefix_module):
    return _single_process(pools, token_dataset_prefix_module)


@pytest.fixture(scope="module")
def initial_weights(pools, token_dataset_prefix_module):
    return pools(1).run(train, base_config(), token_dataset_prefix_module, 0)[0]["params"]


@pytest.fixture(scope="module")
def bf16_reference(reference):
    return lambda micro: reference(micro, bf16={"enabled": True})


def _zero(stage: int) -> dict:
    # stage 3: threshold 0 so that every unit of the tiny model is really partitioned
    return {"stage": stage, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 0}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_matches_single_process(pools, reference, token_dataset_prefix_module, world_size, stage):
    results = pools(world_size).run(train, base_config(zero_optimization=_zero(stage)), token_dataset_prefix_module,
                                    STEPS)
    for rank_result in results:
        _assert_same_run(reference(8 // world_size), rank_result)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_with_accumulation_and_clipping(pools, reference, token_dataset_prefix_module, world_size, stage):
    config = base_config(train_micro_batch_size_per_gpu=8 // world_size // 2, gradient_accumulation_steps=2,
                         zero_optimization=_zero(stage))
    for rank_result in pools(world_size).run(train, config, token_dataset_prefix_module, STEPS):
        _assert_same_run(reference(8 // world_size // 2), rank_result)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size", [2, 4])
def test_bf16_matches_single_process_bf16(pools, bf16_reference, initial_weights, token_dataset_prefix_module,
                                          world_size, stage):
    config = base_config(bf16={"enabled": True}, zero_optimization=_zero(stage))
    for rank_result in pools(world_size).run(train, config, token_dataset_prefix_module, STEPS):
        reference_run = bf16_reference(8 // world_size)
        _assert_same_run(reference_run, rank_result, BF16_LOSS_RTOL, None)
        assert_weights_within_format(rank_result["params"], reference_run["params"], initial_weights, "bf16",
                                     warmup_lr_sum(3e-3, 3, STEPS))


def test_gradient_accumulation_4x1_matches_1x4(pools, token_dataset_prefix_module):
    """Accumulation's arithmetic (1/4 of each micro-batch's loss), dropout on: with layout-invariant
    masks (per sample) a batch of 8 and four micro-batches of 2 draw the same masks, where the
    default mode draws one mask per forward; with the default masks, accumulation is checked
    against data parallelism, which runs the same micro-batches (test_accumulation_with_data_parallel,
    test_data_parallel_matches_...)."""
    invariant = {"dropout_masks": {"layout_invariant": True}}
    whole = pools(1).run(train, base_config(train_micro_batch_size_per_gpu=8, **invariant),
                         token_dataset_prefix_module, STEPS)[0]
    config = base_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4, **invariant)
    accumulated = pools(1).run(train, config, token_dataset_prefix_module, STEPS)[0]
    _assert_same_run(whole, accumulated)


def test_accumulation_with_data_parallel(pools, reference, token_dataset_prefix_module):
    config = base_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    for rank_result in pools(2).run(train, config, token_dataset_prefix_module, STEPS):
        _assert_same_run(reference(2), rank_result)


def _bucket_launch_during_backward(prefix: str) -> dict:
    engine, loader = build_engine(base_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2),
                                  prefix)
    data = iter(loader)
    batch = next(data)
    engine.backward(engine(**batch))
    launched_off_boundary = engine.dp.grads._next_to_launch
    engine.step()
    batch = next(data)
    engine.backward(engine(**batch))
    launched_on_boundary = engine.dp.grads._next_to_launch
    engine.step()
    return {"buckets": engine.dp.grads.bucket_count, "off": launched_off_boundary, "on": launched_on_boundary}


def test_buckets_reduce_during_backward_only_on_boundary(pools, token_dataset_prefix_module):
    for result in pools(2).run(_bucket_launch_during_backward, token_dataset_prefix_module):
        assert result["buckets"] > 2
        assert result["off"] == 0, "no communication before the accumulation boundary"
        assert result["on"] == result["buckets"], "every bucket started during backward"


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_activation_recompute_matches(pools, reference, token_dataset_prefix_module, stage, granularity):
    """Recomputation (inside backward, with ZeRO-3 re-gathering around it) changes nothing."""
    results = pools(2).run(train, base_config(zero_optimization=_zero(stage)), token_dataset_prefix_module, STEPS,
                           0, None, None, None, {"recompute_granularity": granularity})
    for rank_result in results:
        _assert_same_run(reference(4), rank_result)
