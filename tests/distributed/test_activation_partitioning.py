"""Activation checkpointing options at TP=1 and TP=2: gradients bit-for-bit equal to those without
checkpointing (fp32, dropout on), and partitioned inputs really take 1/TP of the memory."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megazero.activation_checkpointing as ac
from megazero import parallel_state, tensor_parallel
from megazero.profiling.memory import ActivationMeter
from models.gpt import GPT, GPTConfig

SMALL = dict(vocab_size=256, seq_length=16, num_layers=3, hidden_size=32, num_attention_heads=4,
             make_vocab_size_divisible_by=64, dropout=0.1)
OPTIONS = {
    "none": {},
    "cpu": {"cpu_checkpointing": True},
    "partition": {"partition_activations": True},
    "partition_contiguous": {"partition_activations": True, "contiguous_memory_optimization": True,
                             "number_checkpoints": 3},
    "partition_contiguous_cpu": {"partition_activations": True, "contiguous_memory_optimization": True,
                                 "number_checkpoints": 3, "cpu_checkpointing": True},
}


def _grads(recompute: str | None, options: dict) -> tuple[dict, int]:
    tp = dist.get_world_size()
    grid = parallel_state.initialize_model_parallel(tp, 1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, recompute_granularity=recompute, tensor_model_parallel_size=tp), grid.tp_group)
    tensor_parallel.model_parallel_seed(2, grid.tp_rank)  # the dropout masks
    ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    ac.configure(parallel_state, **options)
    try:
        with ActivationMeter() as meter:
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
    finally:
        ac.configure()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, meter.bytes


def _compare(option: str) -> dict:
    reference, plain_bytes = _grads(None, {})
    other, kept_bytes = _grads("full", OPTIONS[option])
    differ = [name for name, grad in reference.items() if not torch.equal(grad, other[name])]
    return {"differ": differ, "plain": plain_bytes, "kept": kept_bytes}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_checkpoint_options_bit_for_bit(pools, world_size, option):
    for result in pools(world_size).run(_compare, option):
        assert result["differ"] == []
        assert result["kept"] < result["plain"] / 4  # 3 layer inputs instead of every activation


def _kept_bytes(partition: bool) -> int:
    return _grads("full", {"partition_activations": partition})[1]


def test_partitioned_inputs_take_half_at_tp2(pools):
    whole = pools(2).run(_kept_bytes, False)[0]
    split = pools(2).run(_kept_bytes, True)[0]
    layer_input = 4 * 16 * 32 * 4  # batch x seq x hidden fp32, per checkpointed layer
    assert whole - split == pytest.approx(3 * layer_input / 2, rel=0.01)


def _engine_block(prefix: str) -> str:
    from tests.training_helpers import base_config, train

    config = base_config(activation_checkpointing={"partition_activations": True,
                                                   "contiguous_memory_optimization": True,
                                                   "number_checkpoints": 2})
    try:
        result = train(config, prefix, 2, 0, None, None, None, {"recompute_granularity": "full"}, (2, 1))
    finally:
        ac.configure()
    return result["losses"]


def test_engine_config_block_configures_checkpointing(pools, token_dataset_prefix_module):
    from tests.training_helpers import base_config, train

    expected = pools(2).run(train, base_config(), token_dataset_prefix_module, 2, 0, None, None, None, None,
                            (2, 1))[0]["losses"]
    for losses in pools(2).run(_engine_block, token_dataset_prefix_module):
        assert losses == expected


def test_contiguous_needs_partition_and_slots():
    with pytest.raises(ValueError, match="needs partition_activations"):
        ac.configure(contiguous_memory_optimization=True)
    with pytest.raises(ValueError, match="needs number_checkpoints"):
        ac.configure(partition_activations=True, contiguous_memory_optimization=True)
