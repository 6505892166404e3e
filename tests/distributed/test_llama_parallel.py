"""The Llama (models/llama.py) under every layout the GPT trains at: TP=2 with the key/value
heads split (2 groups) and replicated (1 group: multi-query), TP=2 + SP, PP=2 (with full
recomputation), TP=2 x PP=2 (SP, selective recomputation) and DP=2 with ZeRO 1, 2 and 3 match the
single process for 10 steps, and checkpoints load at another layout.

The harness is test_model_parallel's and test_checkpoint_layouts' (tests/training_helpers.py with
model_overrides' FAMILY "llama"), with their tolerances. The layouts train against the single
process with dropout 0.1 on layout-invariant masks (`dropout_masks.layout_invariant`, reference and
parallel run alike; the default mode's TP rank draws its own masks for its heads, and another
micro-batch size groups the samples' masks otherwise). Dropout is on (0.1) with the default masks
where the claim holds bit for bit: recomputation (tests/unit/test_llama.py) and data parallelism
inside TP=2 (below). The checkpoint cases load on layout-invariant masks too (test_checkpoint_layouts).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_checkpoint_layouts import _assert_continues
from tests.distributed.test_checkpoint_layouts import _run as _run_layout
from tests.distributed.test_model_parallel import (
    GRAD_RTOL,
    LOSS_RTOL,
    PARAM_ATOL,
    STEPS,
    _assert_losses,
    _config,
    assert_matches_reference,
)
from tests.training_helpers import FAMILY, base_config, first_step_gradients, train

LLAMA = {FAMILY: "llama"}  # TINY_LLAMA's dropout 0.1
INVARIANT = {"dropout_masks": {"layout_invariant": True}}  # every layout draws the single process's masks
MQA = {**LLAMA, "num_query_groups": 1}  # 1 key/value head: replicated over 2 TP ranks

# (name, world, (TP, PP), model overrides, zero stage, micro-batch size)
LAYOUTS = [
    ("tp2_kv_split", 2, (2, 1), LLAMA, 0, 8),
    ("tp2_kv_replicated_sp", 2, (2, 1), {**MQA, "sequence_parallel": True}, 0, 8),
    ("tp2_kv_replicated", 2, (2, 1), MQA, 1, 8),
    ("pp2_full_recompute", 2, (1, 2), {**LLAMA, "recompute_granularity": "full"}, 0, 2),
    ("dp2_zero1", 2, (1, 1), LLAMA, 1, 4),
    ("dp2_zero2", 2, (1, 1), LLAMA, 2, 4),
    ("dp2_zero3", 2, (1, 1), LLAMA, 3, 4),
    ("tp2_pp2_sp_selective", 4, (2, 2), {**LLAMA, "sequence_parallel": True, "recompute_granularity": "selective"},
     1, 2),
]


@pytest.fixture(scope="module")
def references(pools, token_dataset_prefix_module) -> dict:
    """The single process, 2 groups and 1 group (dropout on, layout-invariant masks): 10 steps, and
    the first batch's gradients."""
    out = {}
    for name, overrides in (("split", LLAMA), ("mqa", MQA)):
        out[name] = pools(1).run(train, base_config(train_micro_batch_size_per_gpu=8, **INVARIANT),
                                 token_dataset_prefix_module, STEPS, 0, None, None, None, overrides)[0]
        out[name]["grads"] = pools(1).run(first_step_gradients, token_dataset_prefix_module, None, overrides,
                                          INVARIANT)[0]
    return out


@pytest.mark.parametrize("name,world,layout,overrides,stage,micro", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_llama_layout_matches_single_process(pools, references, token_dataset_prefix_module, name, world, layout,
                                             overrides, stage, micro):
    """Losses and final weights over 10 steps, and every parameter's gradient of the first batch."""
    reference = references["mqa" if overrides.get("num_query_groups") == 1 else "split"]
    zero = {"stage": stage, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 0}
    results = pools(world).run(train, _config(stage, micro, **INVARIANT), token_dataset_prefix_module, STEPS, 0, None,
                               None, None, overrides, layout)
    assert_matches_reference(reference, results)
    gradients = pools(world).run(first_step_gradients, token_dataset_prefix_module, layout, overrides,
                                 {"train_micro_batch_size_per_gpu": micro, "zero_optimization": zero, **INVARIANT})
    for grads in gradients:
        assert grads.keys() == reference["grads"].keys()
        for key, expected in reference["grads"].items():
            error = torch.linalg.vector_norm(grads[key] - expected) / torch.linalg.vector_norm(expected)
            assert error <= GRAD_RTOL, f"{key}: relative gradient error {error:.2e}"


def test_llama_data_parallel_inside_tensor_parallel_with_dropout(pools, token_dataset_prefix_module):
    """Dropout 0.1, key/value heads replicated: TP=2 x DP=2 under ZeRO-3 trains exactly as TP=2
    alone accumulating the same micro-batches (same masks), and the TP peers agree bit for bit."""
    overrides = {FAMILY: "llama", "num_query_groups": 1}
    alone = pools(2).run(train, _config(0, 4, gradient_accumulation_steps=2), token_dataset_prefix_module, STEPS, 0,
                         None, None, None, overrides, (2, 1))
    with_dp = pools(4).run(train, _config(3, 4), token_dataset_prefix_module, STEPS, 0, None, None, None, overrides,
                           (2, 1))
    for result in alone + with_dp:
        _assert_losses(alone[0]["losses"], result["losses"], LOSS_RTOL)
        for key, value in alone[0]["params"].items():
            torch.testing.assert_close(result["params"][key], value, rtol=0, atol=PARAM_ATOL, msg=key)
    assert all(torch.equal(alone[1]["params"][k], v) for k, v in alone[0]["params"].items())


# (source, target) as (TP, PP, DP, ZeRO stage), model overrides
CHECKPOINT_CASES = [((2, 2, 1, 1), (1, 1, 2, 3), LLAMA), ((2, 1, 1, 0), (1, 2, 2, 2), MQA)]


@pytest.mark.parametrize("source,target,overrides", CHECKPOINT_CASES, ids=["tp2_pp2_to_dp2_zero3",
                                                                           "tp2_mqa_to_pp2_dp2_zero2"])
def test_llama_checkpoint_loads_at_another_layout(pools, token_dataset_prefix_module, tmp_path, source, target,
                                                  overrides):
    before = _run_layout(pools, token_dataset_prefix_module, source, save_dir=str(tmp_path), model_overrides=overrides)
    after = _run_layout(pools, token_dataset_prefix_module, target, load_dir=str(tmp_path), model_overrides=overrides)
    _assert_continues(before, after)
