"""Measured per-rank model-state bytes agree with the estimate, for every stage."""

from __future__ import annotations

import pytest

from megazero.profiling import estimate_zero_memory, paper_zero_memory
from tests.training_helpers import base_config, build_engine


def _measure(prefix: str, stage: int) -> dict:
    config = base_config(bf16={"enabled": True}, zero_optimization={
        "stage": stage, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 0})
    engine, loader = build_engine(config, prefix)
    engine.train_batch(iter(loader))
    return engine.memory_report()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size", [2, 4])
def test_measured_bytes_match_the_estimate(pools, token_dataset_prefix_module, stage, world_size):
    from models.gpt import GPT, GPTConfig
    from tests.training_helpers import TINY

    num_params = GPT(GPTConfig(**TINY)).num_parameters()
    estimate = estimate_zero_memory(num_params, world_size, stage, precision="bf16", optimizer="adamw")
    for report in pools(world_size).run(_measure, token_dataset_prefix_module, stage):
        for kind in ("parameters", "gradients", "optimizer_states", "total"):
            assert report[kind] == pytest.approx(estimate[kind], rel=0.05), (kind, report, estimate)
        assert report["rss"] > 0


def test_estimate_formulas():
    psi, n = 1_000_000, 4
    assert estimate_zero_memory(psi, n, 0, "bf16")["total"] == 18 * psi
    assert estimate_zero_memory(psi, n, 1, "bf16")["total"] == 6 * psi + 16 * psi / n
    assert estimate_zero_memory(psi, n, 2, "bf16")["total"] == 2 * psi + 16 * psi / n
    assert estimate_zero_memory(psi, n, 3, "bf16")["total"] == 18 * psi / n
    assert estimate_zero_memory(psi, n, 0, "fp32")["total"] == 16 * psi
    assert [paper_zero_memory(psi, n, s) for s in range(4)] == [16 * psi, 7 * psi, 5.5 * psi, 4 * psi]
