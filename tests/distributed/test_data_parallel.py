"""Data parallelism and gradient accumulation match the single-process run (fp32)."""

from __future__ import annotations

import pytest
import torch

from tests.training_helpers import base_config, build_engine, train

STEPS = 10
# fp32: the only difference between layouts is the order of the gradient summation
LOSS_RTOL = 1e-5
PARAM_ATOL = 2e-5


def _assert_same_run(ref: dict, other: dict) -> None:
    assert len(ref["losses"]) == len(other["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(ref["losses"], other["losses"])):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"step {step}: loss {a} vs {b}"
    for name, p in ref["params"].items():
        torch.testing.assert_close(other["params"][name], p, rtol=0, atol=PARAM_ATOL, msg=name)
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.fixture(scope="module")
def reference(pools, token_dataset_prefix_module):
    return pools(1).run(train, base_config(train_micro_batch_size_per_gpu=8), token_dataset_prefix_module,
                        STEPS)[0]


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_matches_single_process(pools, reference, token_dataset_prefix_module, world_size):
    results = pools(world_size).run(train, base_config(), token_dataset_prefix_module, STEPS)
    for rank_result in results:
        _assert_same_run(reference, rank_result)


def test_gradient_accumulation_4x1_matches_1x4(pools, reference, token_dataset_prefix_module):
    config = base_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4)
    accumulated = pools(1).run(train, config, token_dataset_prefix_module, STEPS)[0]
    _assert_same_run(reference, accumulated)


def test_accumulation_with_data_parallel(pools, reference, token_dataset_prefix_module):
    config = base_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    for rank_result in pools(2).run(train, config, token_dataset_prefix_module, STEPS):
        _assert_same_run(reference, rank_result)


def _bucket_launch_during_backward(prefix: str) -> dict:
    engine, loader = build_engine(base_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2),
                                  prefix)
    data = iter(loader)
    batch = next(data)
    engine.backward(engine(**batch))
    launched_off_boundary = engine.grads._next_to_launch
    engine.step()
    batch = next(data)
    engine.backward(engine(**batch))
    launched_on_boundary = engine.grads._next_to_launch
    engine.step()
    return {"buckets": engine.grads.bucket_count, "off": launched_off_boundary, "on": launched_on_boundary}


def test_buckets_reduce_during_backward_only_on_boundary(pools, token_dataset_prefix_module):
    for result in pools(2).run(_bucket_launch_during_backward, token_dataset_prefix_module):
        assert result["buckets"] > 2
        assert result["off"] == 0, "no communication before the accumulation boundary"
        assert result["on"] == result["buckets"], "every bucket started during backward"
