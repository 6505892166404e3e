"""Context parallelism in the models and the engine: GPT and Llama at CP=2, ring (p2p) and
all-to-all (a2a), alone and with TP=2 + SP, PP=2 and DP=2 under ZeRO-1/2/3, train as the single
process does over 10 steps (losses 1e-5, weights 2e-5): the model splits each sample into the
load-balanced chunks at their global positions, the attention spans the group, the gradients are
averaged over DP x CP and the batch is split over DP alone. The layouts run with dropout 0.1 on
layout-invariant masks (every layout draws the single process's masks: the whole sequence's,
each rank keeping its chunks' part), and a few also with dropout 0 (torch's attention kernels).
With the other options (bf16 on the ring's fused kernels, fp16 with loss scaling on all-to-all, the
interleaved pipeline, optimizer offload) CP=2 trains as the single process with the same option
(losses 1e-2 relative in bf16/fp16, as tests/distributed/test_model_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_model_parallel import (
    INTERLEAVED,
    INVARIANT,
    LOSS_RTOL,
    LOW_PRECISION_RTOL,
    PARAM_ATOL,
    STEPS,
    _assert_losses,
    _config,
    assert_matches_reference,
)
from tests.training_helpers import FAMILY, LAYERS_PER_VIRTUAL_STAGE, NO_DROPOUT, build_engine, train

# (name, world, (TP, PP), model overrides, zero stage, micro-batch size); dropout 0.1 on layout-invariant
# masks unless the overrides say dropout 0
DROPOUT_0 = {"dropout": 0.0}
LAYOUTS = [
    ("gpt_cp2_p2p", 2, (1, 1), {"context_parallel_size": 2, "cp_comm_type": "p2p"}, 0, 8),
    ("gpt_cp2_a2a", 2, (1, 1), {"context_parallel_size": 2, "cp_comm_type": "a2a"}, 1, 8),
    ("gpt_cp2_p2p_dropout0", 2, (1, 1), {"context_parallel_size": 2, **DROPOUT_0}, 0, 8),
    ("llama_cp2_p2p", 2, (1, 1), {FAMILY: "llama", "context_parallel_size": 2, "cp_comm_type": "p2p"}, 0, 8),
    ("llama_cp2_a2a_selective", 2, (1, 1), {FAMILY: "llama", "context_parallel_size": 2, "cp_comm_type": "a2a",
                                            "recompute_granularity": "selective"}, 2, 8),
    ("llama_cp2_a2a_dropout0", 2, (1, 1), {FAMILY: "llama", "context_parallel_size": 2, "cp_comm_type": "a2a",
                                           **DROPOUT_0}, 0, 8),
    ("gpt_cp2_tp2_sp", 4, (2, 1), {"context_parallel_size": 2, "sequence_parallel": True}, 0, 8),
    ("llama_cp2_pp2_full_recompute", 4, (1, 2), {FAMILY: "llama", "context_parallel_size": 2,
                                                 "recompute_granularity": "full"}, 0, 4),
    ("gpt_cp2_dp2_zero3", 4, (1, 1), {"context_parallel_size": 2}, 3, 4),
]


@pytest.fixture(scope="module")
def references(pools, token_dataset_prefix_module) -> dict:
    """The single process of each family, dropout 0.1 on layout-invariant masks and dropout 0: 10 steps."""
    out = {}
    for family in ("gpt", "llama"):
        for dropout in (0.1, 0.0):
            extra = INVARIANT if dropout else {}
            out[family, dropout] = pools(1).run(train, _config(0, 8, **extra), token_dataset_prefix_module, STEPS, 0,
                                                None, None, None, {"dropout": dropout, FAMILY: family})[0]
    return out


@pytest.mark.parametrize("name,world,layout,overrides,stage,micro", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_context_parallel_trains_as_the_single_process(pools, references, token_dataset_prefix_module, name, world,
                                                       layout, overrides, stage, micro):
    dropout = overrides.get("dropout", 0.1)
    reference = references[overrides.get(FAMILY, "gpt"), dropout]
    extra = INVARIANT if dropout else {}
    results = pools(world).run(train, _config(stage, micro, **extra), token_dataset_prefix_module, STEPS, 0, None,
                               None, None, {"dropout": dropout, **overrides}, layout)
    assert_matches_reference(reference, results)

BF16 = {"bf16": {"enabled": True}}
FP16 = {"fp16": {"enabled": True, "initial_scale_power": 12}}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
# (name, world, (TP, PP), model overrides, engine config extras, zero extras, zero stage, micro-batch size)
OPTION_LAYOUTS = [
    ("gpt_cp2_p2p_bf16", 2, (1, 1), {"context_parallel_size": 2}, BF16, {}, 1, 8),
    ("llama_cp2_a2a_fp16", 2, (1, 1), {FAMILY: "llama", "context_parallel_size": 2, "cp_comm_type": "a2a"}, FP16, {},
     0, 8),
    ("gpt_cp2_pp2_interleaved", 4, (1, 2), {**INTERLEAVED, "context_parallel_size": 2}, {}, {}, 0, 2),
    ("gpt_cp2_zero2_offload", 2, (1, 1), {"context_parallel_size": 2}, {}, OFFLOAD, 2, 8),
]


@pytest.mark.parametrize("name,world,layout,overrides,extra,zero,stage,micro", OPTION_LAYOUTS,
                         ids=[x[0] for x in OPTION_LAYOUTS])
def test_context_parallel_with_each_option_trains_as_the_single_process(pools, token_dataset_prefix_module, name,
                                                                        world, layout, overrides, extra, zero,
                                                                        stage, micro):
    single = {k: v for k, v in overrides.items() if k not in ("context_parallel_size", "cp_comm_type",
                                                             LAYERS_PER_VIRTUAL_STAGE)}
    reference = pools(1).run(train, _config(0, micro, **extra, **INVARIANT), token_dataset_prefix_module, STEPS, 0,
                             None, None, None, single)[0]
    config = _config(stage, micro, **extra, **INVARIANT)
    config["zero_optimization"].update(zero)
    results = pools(world).run(train, config, token_dataset_prefix_module, STEPS, 0, None, None, None, overrides,
                               layout)
    if extra:
        for result in results:
            _assert_losses(reference["losses"], result["losses"], LOW_PRECISION_RTOL)
            assert result["skipped"] == reference["skipped"]
    else:
        assert_matches_reference(reference, results)


def _what_each_rank_computes(prefix: str) -> tuple[list[int], list[int]]:
    """(the first block's input shape, the global positions) on this rank of a CP=2 GPT."""
    engine, loader = build_engine(_config(0, 8), prefix, 0, {**NO_DROPOUT, "context_parallel_size": 2}, (1, 1))
    shapes = []
    engine.module.blocks[0].register_forward_pre_hook(lambda module, args: shapes.append(list(args[0].shape)))
    engine.train_batch(iter(loader))
    return shapes[0], engine.module.context.positions(32, "cpu").tolist()


def test_each_rank_computes_its_load_balanced_half(pools, token_dataset_prefix_module):
    (shape0, positions0), (shape1, positions1) = pools(2).run(_what_each_rank_computes, token_dataset_prefix_module)
    assert shape0 == shape1 == [8, 16, 64]  # 8 samples, half of the 32 tokens each
    assert positions0 == list(range(0, 8)) + list(range(24, 32)) and positions1 == list(range(8, 24))


def _ring_with_default_dropout(prefix: str) -> str:
    engine, loader = build_engine(_config(0, 8), prefix, 0, {"context_parallel_size": 2}, (1, 1))
    try:
        engine.train_batch(iter(loader))
    except ValueError as e:
        return str(e)
    return "no error"


def test_ring_attention_dropout_needs_the_layout_invariant_masks(pools, token_dataset_prefix_module):
    for message in pools(2).run(_ring_with_default_dropout, token_dataset_prefix_module):
        assert "ring attention (cp_comm_type p2p) with attention dropout needs the layout-invariant masks" in message


MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_z_loss_coeff": 1e-3}  # dropless
# (name, world, (TP, PP, EP), model overrides): MoE layers under CP, their auxiliary losses over whole sequences
MOE_LAYOUTS = [
    ("gpt_moe_cp2_p2p", 2, (1, 1, 1), {**MOE, "context_parallel_size": 2}),
    ("gpt_moe_cp2_ep2_a2a", 2, (1, 1, 2), {**MOE, "context_parallel_size": 2, "cp_comm_type": "a2a"}),
]


@pytest.mark.parametrize("name,world,layout,overrides", MOE_LAYOUTS, ids=[x[0] for x in MOE_LAYOUTS])
def test_moe_under_context_parallelism_trains_as_the_single_process(pools, token_dataset_prefix_module, name, world,
                                                                    layout, overrides):
    single = {k: v for k, v in overrides.items() if k not in ("context_parallel_size", "cp_comm_type")}
    reference = pools(1).run(train, _config(0, 8, **INVARIANT), token_dataset_prefix_module, STEPS, 0, None, None,
                             None, single)[0]
    results = pools(world).run(train, _config(0, 8, **INVARIANT), token_dataset_prefix_module, STEPS, 0, None, None,
                               None, overrides, layout)
    ep = layout[2]
    for rank, result in enumerate(results):
        _assert_losses(reference["losses"], result["losses"], LOSS_RTOL)
        for key, value in reference["params"].items():
            if result["params"][key].shape != value.shape:  # this EP rank's experts (EP inside DP x CP: rank % EP)
                value = value.chunk(ep, dim=0)[rank % ep]
            torch.testing.assert_close(result["params"][key], value, rtol=0, atol=PARAM_ATOL, msg=key)
    assert reference["losses"][-1] < reference["losses"][0]


def test_context_and_expert_parallel_sizes_must_divide_one_another():
    from megazero.parallel_state import grid_groups

    groups = grid_groups(4, expert_model_parallel_size=2, context_parallel_size=2)
    assert groups["ep"] == groups["cp"] == [(0, 1), (2, 3)]
    assert grid_groups(8, expert_model_parallel_size=4, context_parallel_size=2)["ep"] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    with pytest.raises(ValueError, match=r"context_parallel_size 2 and expert_model_parallel_size 3: one must "
                                         r"divide the other"):
        grid_groups(6, expert_model_parallel_size=3, context_parallel_size=2)
