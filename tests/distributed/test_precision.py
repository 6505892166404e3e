"""fp16/bf16 training, overflow skipping, and the engine step against plain torch."""

from __future__ import annotations

import copy

import pytest
import torch

import megazero
from megazero.zero import GatheredParameters
from models.gpt import GPT, GPTConfig
from tests.precision_bounds import assert_weights_within_format, warmup_lr_sum
from tests.training_helpers import TINY, base_config, build_engine, train


def _overflow_step(prefix: str, stage: int) -> dict:
    config = base_config(train_micro_batch_size_per_gpu=4,
                         zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0},
                         fp16={"enabled": True, "initial_scale_power": 10, "hysteresis": 2})
    engine, loader = build_engine(config, prefix)
    data = iter(loader)
    engine.train_batch(data)  # one clean step, so the optimizer has state
    with GatheredParameters(list(engine.module.parameters())):
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    state_before = copy.deepcopy(engine.optimizer.state_dict())
    results = []
    for _ in range(2):
        batch = next(data)
        loss = engine(**batch)
        if engine.dp_rank == 0:  # only one rank sees the overflow
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        results.append(engine.get_loss_scale())
    with GatheredParameters(list(engine.module.parameters())):
        unchanged = all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    assert all(t.numel() > 0 for t in before.values())
    state_after = engine.optimizer.state_dict()
    same_state = all(torch.equal(state_before["state"][k]["exp_avg"], v["exp_avg"])
                     for k, v in state_after["state"].items())
    engine.train_batch(data)  # and training goes on
    return {"unchanged": unchanged, "same_state": same_state, "scales": results, "skipped": engine.skipped_steps,
            "steps": engine.global_steps, "finite": all(torch.isfinite(p).all() for p in engine.module.parameters())}


def _lr_after_overflow(prefix: str) -> list:
    config = base_config(train_micro_batch_size_per_gpu=8, fp16={"enabled": True, "initial_scale_power": 10})
    engine, loader = build_engine(config, prefix)
    data = iter(loader)
    lrs = [engine.get_lr()[0]]
    for poison in (False, True, False):
        loss = engine(**next(data))
        engine.backward(loss * float("nan") if poison else loss)
        engine.step()
        lrs.append(engine.get_lr()[0])
    return lrs


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(pools, token_dataset_prefix_module, stage):
    for result in pools(2).run(_overflow_step, token_dataset_prefix_module, stage):
        assert result["unchanged"] and result["same_state"]
        assert result["scales"] == [1024.0, 512.0]  # hysteresis 2: the second overflow halves
        assert result["skipped"] == 2 and result["steps"] == 4 and result["finite"]


def test_skipped_step_leaves_the_lr_schedule(pools, token_dataset_prefix_module):
    lrs = pools(1).run(_lr_after_overflow, token_dataset_prefix_module)[0]
    # linear warm-up over 3 steps to 3e-3: 0, 0 (step 0), skip, 1e-3
    assert lrs == [0.0, 0.0, 0.0, 1e-3]


def test_bf16_and_fp16_track_fp32(pools, token_dataset_prefix_module):
    """16-bit compute with fp32 master weights: losses within 2% of fp32 over 10 steps, and weights
    within the bound that the format's unit roundoff, the LRs and AdamW give (derived in
    tests/precision_bounds.py)."""
    initial = pools(2).run(train, base_config(), token_dataset_prefix_module, 0)[0]["params"]
    results = {}
    for name, extra in (("fp32", {}), ("bf16", {"bf16": {"enabled": True}}),
                        ("fp16", {"fp16": {"enabled": True, "initial_scale_power": 12}})):
        results[name] = pools(2).run(train, base_config(**extra), token_dataset_prefix_module, 10)[0]
    for name in ("bf16", "fp16"):
        for a, b in zip(results["fp32"]["losses"], results[name]["losses"]):
            assert abs(a - b) <= 0.02 * a, (name, a, b)
        assert results[name]["losses"][-1] < results[name]["losses"][0] - 0.3
        assert results[name]["skipped"] == 0
        assert_weights_within_format(results[name]["params"], results["fp32"]["params"], initial, name,
                                     warmup_lr_sum(3e-3, 3, 10))


def _engine_vs_torch(prefix: str) -> float:
    megazero.set_seed(0)
    model = GPT(GPTConfig(**TINY))
    reference = copy.deepcopy(model)
    config = base_config(train_micro_batch_size_per_gpu=8, scheduler=None, gradient_clipping=0.05)
    config.pop("scheduler")
    engine, _, _, _ = megazero.initialize(model=model, config=config)
    opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.randint(0, 256, (8, TINY["seq_length"] + 1), generator=gen)
        engine.backward(engine(ids[:, :-1], ids[:, 1:]))
        engine.step()
        with engine.rng_streams.micro_batch(step, 0):  # dropout on: the engine's masks for this micro-batch
            loss = reference(ids[:, :-1], ids[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))


def test_engine_step_equals_torch_adamw_with_clipping(pools, token_dataset_prefix_module):
    # the global norm is summed in another order than clip_grad_norm_'s (one flat buffer vs per
    # tensor); Adam's normalised update turns that fp32 rounding into ~1e-6 after 3 steps of lr 3e-3
    assert pools(1).run(_engine_vs_torch, token_dataset_prefix_module)[0] < 3e-6
