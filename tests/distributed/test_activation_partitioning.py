"""Activation checkpointing options at TP=1 and TP=2: gradients bit-for-bit equal to those without
checkpointing (fp32, dropout on), and partitioned inputs really take 1/TP of the memory."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megazero.activation_checkpointing as ac
from megazero import parallel_state, tensor_parallel
from megazero.profiling.memory import ActivationMeter
from models.gpt import GPTConfig
from models.parallelize import parallelize

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
    model = parallelize(GPTConfig(**SMALL, recompute_granularity=recompute, tensor_model_parallel_size=tp), grid)
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


ENGINE_BLOCK = {"partition_activations": True, "contiguous_memory_optimization": True, "number_checkpoints": 2,
                "synchronize_checkpoint_boundary": True, "profile": True}


def _engine_block(prefix: str, block: dict | None) -> dict:
    """Two steps of the tiny GPT at TP=2 (full recompute, dropout on), with or without the engine's
    activation_checkpointing block; what the block changed is read back from the run."""
    from tests.training_helpers import base_config, build_engine, global_mean

    config = base_config(**({"activation_checkpointing": block} if block is not None else {}))
    try:
        engine, loader = build_engine(config, prefix, 0, {"recompute_granularity": "full", "dropout": 0.1}, (2, 1))
        data = iter(loader)
        losses = [global_mean(engine.train_batch(data).item(), engine) for _ in range(2)]
        slots = ac._BUFFER.storage.shape[0] if ac._BUFFER.storage is not None else 0
        return {"losses": losses, "settings": ac.settings(), "stats": ac.checkpoint_stats(), "slots": slots,
                "kept": engine.last_activation_bytes}
    finally:
        ac.configure()


def test_engine_config_block_configures_checkpointing(pools, token_dataset_prefix_module):
    """The block's options take effect through initialize(): settings, 1/TP of the layer inputs kept,
    the contiguous buffer's slots, a synchronization at each of the 4 boundaries of every
    checkpointed layer, the profile's timings; and the losses stay exactly those without it."""
    plain = pools(2).run(_engine_block, token_dataset_prefix_module, None)
    configured = pools(2).run(_engine_block, token_dataset_prefix_module, ENGINE_BLOCK)
    layer_input = 8 * 32 * 64 * 4  # micro-batch x seq x hidden fp32, per checkpointed layer
    for without, with_block in zip(plain, configured):
        assert with_block["losses"] == without["losses"]
        assert {k: with_block["settings"][k] for k in ("partition_activations", "contiguous_memory_optimization",
                                                       "number_checkpoints", "synchronize", "profile")} == {
            "partition_activations": True, "contiguous_memory_optimization": True, "number_checkpoints": 2,
            "synchronize": True, "profile": True}
        assert not any(without["settings"].values())
        assert without["kept"] - with_block["kept"] == 2 * layer_input // 2  # two layer inputs, half kept
        assert with_block["slots"] == 2 and without["slots"] == 0
        checkpointed = 2 * 2  # layers x steps (one micro-batch per step)
        assert with_block["stats"]["forwards"] == with_block["stats"]["recomputes"] == checkpointed
        assert with_block["stats"]["synchronized_boundaries"] == 4 * checkpointed
        assert with_block["stats"]["forward_ms"] > 0 and with_block["stats"]["backward_ms"] > 0
        assert without["stats"]["synchronized_boundaries"] == 0 and without["stats"]["forward_ms"] == 0


def test_contiguous_needs_partition_and_slots():
    with pytest.raises(ValueError, match="needs partition_activations"):
        ac.configure(contiguous_memory_optimization=True)
    with pytest.raises(ValueError, match="needs number_checkpoints"):
        ac.configure(partition_activations=True, contiguous_memory_optimization=True)
