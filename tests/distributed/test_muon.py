"""Muon through the engine, dropout 0.1 with layout-invariant masks: ZeRO stages 0-3 on 2 data-
parallel ranks, TP=2 (GPT's fused [Q; K; V], Llama's [K; V] and [gate; up] orthogonalised per
logical matrix over the gathered shards), PP=2 and TP=2 x DP=2 at ZeRO-3 match the single process
over 10 steps. Newton-Schulz in fp32 here (`ns_dtype`), so that the layouts differ only by the
order of the gradient sums: losses within 1e-5 relative, weights within 2e-5 (the unit tests check
the bf16 iteration against the reference's)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_layout_invariant_dropout import ZERO3, run_moe
from tests.training_helpers import FAMILY, base_config, train

STEPS, LOSS_RTOL, PARAM_ATOL = 10, 1e-5, 2e-5
MUON = {"type": "Muon", "params": {"lr": 0.02, "weight_decay": 0.01, "ns_dtype": "float32", "adamw_lr": 3e-3,
                                   "adamw_weight_decay": 0.1}}
# GPT's attention key bias has an exact gradient of zero (softmax cancels it): what it gets is each
# layout's rounding noise, which AdamW's normalisation turns into steps of up to adamw_lr either way
KEY_BIAS_BOUND = 2 * STEPS * MUON["params"]["adamw_lr"] + PARAM_ATOL


def _config(micro: int, **extra) -> dict:
    config = base_config(optimizer=MUON, train_micro_batch_size_per_gpu=micro,
                         dropout_masks={"layout_invariant": True}, **extra)
    del config["scheduler"]  # WarmupLR sets one absolute LR for all groups; Muon's and AdamW's differ
    return config


def _zero(stage: int) -> dict:
    return {"stage": stage, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 0}


def _assert_matches(reference: dict, result: dict, what: str) -> None:
    assert len(result["losses"]) == len(reference["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(reference["losses"], result["losses"])):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"{what} step {step}: loss {a} vs {b}"
    for name, value in reference["params"].items():
        diff = (result["params"][name] - value).abs()
        if name.endswith("attn.qkv.bias"):  # the key bias: see KEY_BIAS_BOUND
            q, k, v = diff.chunk(3)
            assert float(k.max()) <= KEY_BIAS_BOUND, (what, name, float(k.max()))
            diff = torch.cat([q, v])
        assert float(diff.max()) <= PARAM_ATOL, (what, name, float(diff.max()))


@pytest.fixture(scope="module")
def references(pools, token_dataset_prefix_module):
    """family -> the single process, the global batch of 8 as one micro-batch."""
    made = {}

    def get(family: str) -> dict:
        if family not in made:
            made[family] = pools(1).run(train, _config(8), token_dataset_prefix_module, STEPS, 0, None, None, None,
                                        {FAMILY: family})[0]
            assert made[family]["losses"][-1] < made[family]["losses"][0] - 0.5, made[family]["losses"]
        return made[family]

    return get


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_muon_under_zero_matches_single_process(pools, references, token_dataset_prefix_module, stage):
    config = _config(4, zero_optimization=_zero(stage))
    for rank, result in enumerate(pools(2).run(train, config, token_dataset_prefix_module, STEPS)):
        _assert_matches(references("gpt"), result, f"ZeRO-{stage} DP=2 rank {rank}")


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_muon_tensor_parallel_matches_single_process(pools, references, token_dataset_prefix_module, family):
    results = pools(2).run(train, _config(8), token_dataset_prefix_module, STEPS, 0, None, None, None,
                           {FAMILY: family}, (2, 1))
    for rank, result in enumerate(results):
        _assert_matches(references(family), result, f"{family} TP=2 rank {rank}")


def test_muon_pipeline_and_tp_zero3_match_single_process(pools, references, token_dataset_prefix_module):
    for rank, result in enumerate(pools(2).run(train, _config(4, zero_optimization=_zero(1)),
                                               token_dataset_prefix_module, STEPS, 0, None, None, None, None, (1, 2))):
        _assert_matches(references("gpt"), result, f"PP=2 ZeRO-1 rank {rank}")
    for rank, result in enumerate(pools(4).run(train, _config(4, zero_optimization=_zero(3)),
                                               token_dataset_prefix_module, STEPS, 0, None, None, None,
                                               {FAMILY: "llama"}, (2, 1))):
        _assert_matches(references("llama"), result, f"llama TP=2 x DP=2 ZeRO-3 rank {rank}")


@pytest.mark.parametrize("stage", [2, 3])
def test_muon_moe_expert_parallel_matches_single_process(pools, stage):
    """The MoE GPT (4 experts, capacity mode) at EP=2 on DP=2, ZeRO-2 and 3: each expert's matrix is
    orthogonalised alone on the rank holding it, the dense ones over the data-parallel group."""
    reference = pools(1).run(run_moe, None, MUON)[0]  # random tokens: the loss stays near ln(64)
    zero = ZERO3 if stage == 3 else {"stage": 2}
    for rank, result in enumerate(pools(2).run(run_moe, 2, MUON, zero)):
        for step, (a, b) in enumerate(zip(reference["losses"], result["losses"])):
            assert abs(a - b) <= LOSS_RTOL * abs(a), f"EP=2 ZeRO-{stage} rank {rank} step {step}: loss {a} vs {b}"
        for name, value in reference["params"].items():
            diff = float((result["params"][name] - value).abs().max())
            bound = KEY_BIAS_BOUND if name.endswith("attn.qkv.bias") else PARAM_ATOL
            assert diff <= bound, (rank, name, diff)


def test_muon_checkpoint_resumes_bit_for_bit_and_recuts_at_another_dp_size(pools, references,
                                                                           token_dataset_prefix_module, tmp_path):
    """A ZeRO-1 DP=2 checkpoint of step 5 (momentum buffers and AdamW moments partitioned) resumes
    at the same layout exactly as the run that never stopped, and in one process (DP=1, ZeRO-0) as
    the single process does."""
    config, prefix, saved = _config(4, zero_optimization=_zero(1)), token_dataset_prefix_module, str(tmp_path / "c")
    straight = pools(2).run(train, config, prefix, STEPS, 0, saved, STEPS // 2)[0]
    resumed = pools(2).run(train, config, prefix, STEPS, 0, None, None, saved)[0]
    assert resumed["losses"] == straight["losses"][STEPS // 2:]
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    recut = pools(1).run(train, _config(8), prefix, STEPS, 0, None, None, saved)[0]
    reference = references("gpt")
    for step, (a, b) in enumerate(zip(reference["losses"][STEPS // 2:], recut["losses"])):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"re-cut step {step}: loss {a} vs {b}"
    for name, value in reference["params"].items():
        if not name.endswith("attn.qkv.bias"):  # KEY_BIAS_BOUND: checked by the layouts above
            torch.testing.assert_close(recut["params"][name], value, rtol=0, atol=PARAM_ATOL, msg=name)
