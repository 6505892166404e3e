"""ZeRO-3's options as users leave or set them: the default persistence threshold (small parameters
stay whole), prefetch on and off, `reduce_bucket_size` and `overlap_comm` true and false. Each
equals the single process with dropout on, and each option has its observable effect."""

from __future__ import annotations

import pytest
import torch

from megazero.zero.collectives import traffic
from tests.training_helpers import base_config, build_engine, full_parameters, global_mean

STEPS = 6
# hidden 192: the layers' matrices (110,592 and 147,456 elements) are over the default persistence
# threshold of 1e5 and partitioned; biases, norms, the attention output (36,864) and the
# embeddings stay whole
MODEL = {"hidden_size": 192, "dropout": 0.1}
SMALL_BUCKETS = 100_000
# fp32: the single process accumulates 2 micro-batches of 4 where 2 ranks each run one and ZeRO-3
# reduce-scatters pre-divided buckets: only the order of the gradient summation differs (the
# dropout masks are the same: micro-batch i of a step draws the same stream at every DP size)
LOSS_RTOL = 1e-5
PARAM_ATOL = 2e-5


def _train_and_observe(prefix: str, zero: dict, extra: dict | None = None) -> dict:
    """STEPS optimizer steps of the tiny GPT (dropout on) at `zero` (and the `extra` config keys);
    per step, the reduce-scatter calls and the largest one, and what ZeRO-3 did (when stage 3)."""
    engine, loader = build_engine(base_config(zero_optimization=zero, **(extra or {})), prefix,
                                  model_overrides=MODEL)
    data = iter(loader)
    losses, steps = [], []
    for _ in range(STEPS):
        traffic.reset()
        losses.append(global_mean(engine.train_batch(data).item(), engine))
        steps.append({"calls": traffic.calls.get("reduce_scatter", 0),
                      "largest": traffic.largest.get("reduce_scatter", 0)})
    out = {"losses": losses, "params": full_parameters(engine), "steps": steps}
    if zero["stage"] == 3:
        dp = engine.dp
        shards = [s for u in dp.units for s in u.shards]
        out.update(
            buckets=dp.bucket_count, prefetches=dp.prefetches,
            launched_in_backward=dp.grads.launched_in_backward, peak_in_flight=dp.grads.peak_in_flight,
            whole=[p.numel() for s in shards if s.persistent for p in s.layout.params],
            partitioned=[s.layout.numels[p] for s in shards if not s.persistent for p in s.layout.params],
            held_outside_forward=[p.numel() for s in shards if not s.persistent for p in s.layout.params],
            layer_numel=sum(p.numel() for p in engine.module.blocks[0].parameters()),
            partitioned_units=sum(1 for u in dp.units if u.numel),
            model_numel=sum(s.layout.unpadded_numel for s in shards))
    return out


@pytest.fixture(scope="module")
def single_process(pools, token_dataset_prefix_module):
    """The single process: each step's batch of 8 as 2 accumulated micro-batches of 4, the 2 ranks'
    micro-batches (the same samples, the same dropout masks)."""
    return pools(1).run(_train_and_observe, token_dataset_prefix_module, {"stage": 0},
                        {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})[0]


def _assert_same_run(ref: dict, other: dict) -> None:
    for step, (a, b) in enumerate(zip(ref["losses"], other["losses"], strict=True)):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"step {step}: loss {a} vs {b}"
    for name, p in ref["params"].items():
        torch.testing.assert_close(other["params"][name], p, rtol=0, atol=PARAM_ATOL, msg=name)
    assert ref["losses"][-1] < ref["losses"][0]


def test_stage3_defaults_keep_small_parameters_whole_and_prefetch(pools, single_process, token_dataset_prefix_module):
    """`{"stage": 3}` and nothing else: equal to data parallelism; parameters under 1e5 elements are
    never partitioned, the others are held as empty tensors outside forward/backward, and the next
    layer is gathered ahead of use from the second step on."""
    for result in pools(2).run(_train_and_observe, token_dataset_prefix_module, {"stage": 3}):
        _assert_same_run(single_process, result)
        assert result["whole"] and max(result["whole"]) < 100_000, result["whole"]
        assert result["partitioned"] and min(result["partitioned"]) >= 100_000, result["partitioned"]
        assert result["held_outside_forward"] == [0] * len(result["partitioned"])
        # the units with partitioned parameters (2 layers x qkv, fc, proj): from step 2 on, each
        # forward prefetches every one of them (the first while the embeddings run), and each
        # backward again (the last while the head's backward runs)
        assert result["partitioned_units"] == 6, result["partitioned_units"]
        assert result["prefetches"] == 2 * result["partitioned_units"] * (STEPS - 1), result["prefetches"]


def test_stage3_without_prefetch(pools, single_process, token_dataset_prefix_module):
    zero = {"stage": 3, "stage3_prefetch_bucket_size": 0}
    for result in pools(2).run(_train_and_observe, token_dataset_prefix_module, zero):
        _assert_same_run(single_process, result)
        assert result["prefetches"] == 0


def test_stage3_reduce_bucket_size_sets_the_reduce_scatters(pools, single_process, token_dataset_prefix_module):
    """The default 5e8 elements puts the whole tiny model into one reduce-scatter per step, as in
    DeepSpeed; 1e5 cuts it into buckets that each close at the first parameter reaching 1e5
    elements, so none is larger than 1e5 plus one parameter (147,456) and padding."""
    default, small = (pools(2).run(_train_and_observe, token_dataset_prefix_module, zero)[0]
                      for zero in ({"stage": 3}, {"stage": 3, "reduce_bucket_size": SMALL_BUCKETS}))
    for result in (default, small):
        _assert_same_run(single_process, result)
    padded_model = default["steps"][0]["largest"]
    assert default["buckets"] == 1
    assert all(s["calls"] == 1 for s in default["steps"]) and padded_model >= default["model_numel"]
    assert small["buckets"] >= small["model_numel"] // (SMALL_BUCKETS + 147_456) > 1, small["buckets"]
    for step in small["steps"]:
        assert step["calls"] == small["buckets"]
        assert step["largest"] < SMALL_BUCKETS + 147_456 + 2, step


@pytest.mark.parametrize("overlap", [True, False])
def test_stage3_overlap_comm(pools, single_process, token_dataset_prefix_module, overlap):
    """Every bucket starts inside backward, as soon as its gradients are in. overlap_comm true: the
    reduce-scatters run while backward goes on (several in flight at once); false: each is waited
    for in the hook that starts it, so never more than one is in flight."""
    zero = {"stage": 3, "reduce_bucket_size": SMALL_BUCKETS, "overlap_comm": overlap}
    for result in pools(2).run(_train_and_observe, token_dataset_prefix_module, zero):
        _assert_same_run(single_process, result)
        assert result["buckets"] > 2
        assert result["launched_in_backward"] == result["buckets"]
        if overlap:
            assert result["peak_in_flight"] >= 2, result["peak_in_flight"]
        else:
            assert result["peak_in_flight"] == 1, result["peak_in_flight"]

