"""zero.Init builds a model already partitioned; GatheredParameters gathers it for user code."""

from __future__ import annotations

import os
import resource

import pytest
import torch

import megazero
from megazero.data import GPTDataset, IndexedDataset
from megazero.profiling.memory import current_rss_bytes
from megazero.zero import GatheredParameters, Init
from megazero.zero.init import partition_device
from models.gpt import GPT, GPTConfig
from tests.process_pool import ProcessPool
from tests.training_helpers import TINY, base_config, global_mean

STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0}


def _init_matches_plain_and_trains(prefix: str) -> dict:
    megazero.set_seed(0)
    plain = GPT(GPTConfig(**TINY))
    megazero.set_seed(0)
    with Init():
        model = GPT(GPTConfig(**TINY))
    local = sum(p.numel() for p in model.parameters())
    engine, _, loader, _ = megazero.initialize(
        model=model, training_data=GPTDataset(IndexedDataset(prefix), TINY["seq_length"], seed=0),
        config=base_config(zero_optimization=STAGE3))
    with GatheredParameters(list(engine.module.parameters())):
        same = all(torch.equal(p, q) for p, q in zip(engine.module.parameters(), plain.parameters()))
    data = iter(loader)
    losses = [global_mean(engine.train_batch(data).item(), engine) for _ in range(3)]
    return {"same": same, "local_after_init": local, "losses": losses}


def _plain_losses(prefix: str) -> list:
    megazero.set_seed(0)
    engine, _, loader, _ = megazero.initialize(
        model=GPT(GPTConfig(**TINY)), training_data=GPTDataset(IndexedDataset(prefix), TINY["seq_length"], seed=0),
        config=base_config(zero_optimization=STAGE3))
    data = iter(loader)
    return [global_mean(engine.train_batch(data).item(), engine) for _ in range(3)]


def test_init_builds_the_same_model_partitioned(pools, token_dataset_prefix_module):
    results = pools(2).run(_init_matches_plain_and_trains, token_dataset_prefix_module)
    reference = pools(2).run(_plain_losses, token_dataset_prefix_module)[0]
    for result in results:
        assert result["same"], "the Init-built model differs from the plain one"
        assert result["local_after_init"] == 0, "after Init no parameter is held whole"
        assert result["losses"] == pytest.approx(reference, rel=1e-6)


def _modify_on_rank_one(prefix: str) -> list:
    megazero.set_seed(0)
    engine, _, _, _ = megazero.initialize(model=GPT(GPTConfig(**TINY)), config=base_config(zero_optimization=STAGE3))
    weight = engine.module.blocks[0].mlp.fc.weight
    with GatheredParameters([weight], modifier_rank=1):
        if engine.dp_rank == 1:
            weight.data.fill_(0.25)
    assert weight.numel() == 0  # released again
    with GatheredParameters([weight]):
        seen = weight.detach().clone()
    shard = weight._megazero_shard
    pieces = [shard.master_flat.detach()[f.partition_start:f.partition_start + f.numel]
              for f in shard.layout.fragments(engine.dp_rank) if f.param is weight]
    return [bool((seen == 0.25).all()), bool(pieces) and all(bool((x == 0.25).all()) for x in pieces)]


def test_gathered_parameters_keeps_the_modifier_ranks_change(pools, token_dataset_prefix_module):
    for gathered_ok, master_ok in pools(2).run(_modify_on_rank_one, token_dataset_prefix_module):
        assert gathered_ok and master_ok


BIG = dict(vocab_size=1000, seq_length=16, num_layers=12, hidden_size=1024, num_attention_heads=16)


def _peak_rss_growth_building(use_init: bool) -> dict:
    before = current_rss_bytes()  # now, not the lifetime peak: start-up may have peaked higher
    megazero.set_seed(0)
    with Init(enabled=use_init):
        model = GPT(GPTConfig(**BIG))
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    def numel(p: torch.nn.Parameter) -> int:
        return int(torch.Size(getattr(p, "_megazero_init_shape", p.shape)).numel())

    held = sum(p.numel() + getattr(p, "_megazero_init_chunk", torch.empty(0)).numel() for p in model.parameters()) * 4
    return {"growth": growth, "full": sum(numel(p) for p in model.parameters()) * 4, "held": held,
            "layer": sum(numel(p) for p in model.blocks[0].parameters()) * 4,
            "largest": max(numel(p) for p in model.parameters()) * 4}


@pytest.mark.slow
def test_init_never_holds_the_whole_model():
    """A 151M-parameter GPT (581 MiB fp32) built on 2 ranks: each rank's peak memory grows by less
    than half of it (its chunks) plus one layer (the subtree being built, whole until its parent's
    __init__ returns), far below the whole model."""
    # fresh processes (ru_maxrss is a lifetime peak) in which glibc returns every freed block of 64 KiB
    # or more to the system, so that the peak RSS follows the live tensors rather than heap fragmentation
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        measured = {}
        for use_init in (True, False):
            pool = ProcessPool(2)
            measured[use_init] = pool.run(_peak_rss_growth_building, use_init)
            pool.close()
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
    for result in measured[True]:  # measured: 324 MiB of 581 MiB (half: 290, one layer: 48)
        assert abs(result["held"] - result["full"] / 2) < 0.01 * result["full"]
        bound = result["full"] / 2 + result["layer"]
        assert result["growth"] < bound, {k: v / 2**20 for k, v in result.items()}
    for result in measured[False]:  # the same measurement sees the whole model without Init
        assert result["growth"] > 0.9 * result["full"], (result["growth"] / 2**20, result["full"] / 2**20)


# ---- where the partitions live ---------------------------------------------------------------
@pytest.mark.parametrize("local_rank, device_count, index", [(0, 8, 0), (5, 8, 5), (3, 1, 0), (5, 4, 1)])
def test_under_nccl_partitions_go_to_the_ranks_training_gpu(local_rank, device_count, index):
    from megazero.distributed import training_device

    device = partition_device("nccl", local_rank=local_rank, device_count=device_count)
    assert device == torch.device("cuda", index) == training_device(local_rank, device_count)


def test_an_explicit_device_wins_and_gloo_keeps_where_each_parameter_was_built():
    assert partition_device("nccl", "cpu", local_rank=3, device_count=4) == torch.device("cpu")
    assert partition_device("gloo", "cuda:1") == torch.device("cuda", 1)
    assert partition_device("gloo") is None
    with pytest.raises(RuntimeError, match="NCCL but this process sees no GPU"):
        partition_device("nccl", local_rank=0, device_count=0)


def _init_placement(device) -> dict:
    megazero.set_seed(0)
    init = Init(device=device)
    with init:
        model = GPT(GPTConfig(**TINY))
    params = list(model.parameters())
    return {"device": init.device, "chunks": {str(p._megazero_init_chunk.device) for p in params},
            "params": {str(p.device) for p in params}, "empty": all(p.numel() == 0 for p in params)}


def test_init_keeps_its_chunks_and_emptied_parameters_on_the_device_it_chose(pools):
    for result in pools(2).run(_init_placement, "cpu"):
        assert result == {"device": torch.device("cpu"), "chunks": {"cpu"}, "params": {"cpu"}, "empty": True}
    for result in pools(2).run(_init_placement, None):  # gloo: where each parameter was built
        assert result == {"device": None, "chunks": {"cpu"}, "params": {"cpu"}, "empty": True}
