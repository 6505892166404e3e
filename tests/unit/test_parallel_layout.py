"""Shard/merge of tensor-parallel weights, pipeline stage balancing, the bubble formula."""

from __future__ import annotations

import pytest
import torch

from megazero.pipeline import balanced_stage_layers, bubble_fraction
from megazero.tensor_parallel import merge_shards, shard_of
from models.gpt import GPTConfig
from models.parallelize import stage_layers


@pytest.mark.parametrize("stride", [1, 3])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_shard_merge_round_trip(world, stride):
    full = torch.arange(24 * 5, dtype=torch.float32).view(24, 5)
    shards = [shard_of(full, 0, world, r, stride) for r in range(world)]
    assert all(s.shape == (24 // world, 5) for s in shards)
    torch.testing.assert_close(merge_shards(shards, 0, stride), full, rtol=0, atol=0)


def test_strided_shard_holds_each_block_slice():
    """Fused [Q; K; V] rows: rank r holds rows r of each of the three blocks."""
    full = torch.arange(12).view(12, 1)  # Q rows 0-3, K rows 4-7, V rows 8-11
    assert shard_of(full, 0, 2, 1, stride=3).view(-1).tolist() == [2, 3, 6, 7, 10, 11]


def test_shard_of_rejects_indivisible():
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 4"):
        shard_of(torch.zeros(6, 2), 0, 4, 0)


def test_balanced_stage_layers():
    assert balanced_stage_layers([1] * 4, 2) == [range(0, 2), range(2, 4)]
    # heavy embeddings on the first stage push layers to the others
    assert balanced_stage_layers([1] * 6, 2, first_extra=2) == [range(0, 2), range(2, 6)]
    stages = balanced_stage_layers([5, 1, 1, 1, 1, 1], 3)
    assert stages[0] == range(0, 1) and max(len(s) for s in stages[1:]) <= 4  # the heavy layer alone
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        balanced_stage_layers([1, 1], 3)


def test_gpt_stages_cover_all_layers_once():
    config = GPTConfig(num_layers=12, hidden_size=64, num_attention_heads=4)
    stages = stage_layers(config, 4)
    assert [i for r in stages for i in r] == list(range(12))
    assert len(stages[0]) <= len(stages[1])  # the embedding weighs on the first stage


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)


def test_vocab_padding_follows_tensor_parallel_size():
    assert GPTConfig(vocab_size=8000).padded_vocab_size == 8064
    assert GPTConfig(vocab_size=8000, tensor_model_parallel_size=2, num_attention_heads=6).padded_vocab_size == 8192
    with pytest.raises(ValueError, match="num_attention_heads 6 is not divisible by tensor_model_parallel_size 4"):
        GPTConfig(tensor_model_parallel_size=4, num_attention_heads=6)


def test_interleaved_split_balances_each_ranks_total():
    """v > 1 (compute and measured splits): each rank's chunks' sum is balanced, then its chunks;
    a head of 2.1 layers on the last virtual stage (rank 1's chunk 1) leaves rank 1 5.1 layers of
    work to rank 0's 5; one of 3.5 layers, 5.5 to 6, where balancing each virtual stage alone
    (largest 4.5) gives rank 1 6.5 of 11.5."""
    from megazero.pipeline.partition import balanced_interleaved_layers

    split = balanced_interleaved_layers([100] * 8, 2, 2, 0, 210)
    assert split == [range(0, 3), range(3, 5), range(5, 7), range(7, 8)]
    totals = [len(split[s]) * 100 + len(split[2 + s]) * 100 + (210 if s else 0) for s in range(2)]
    assert totals == [500, 510]
    assert balanced_interleaved_layers([100] * 8, 2, 2, 0, 350) == [range(0, 3), range(3, 4), range(4, 7),
                                                                     range(7, 8)]
    assert balanced_stage_layers([100] * 8, 4, 0, 350) == [range(0, 2), range(2, 4), range(4, 7), range(7, 8)]
    assert balanced_interleaved_layers([1] * 8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="cannot split 3 layers into 2 x 2"):
        balanced_interleaved_layers([1] * 3, 2, 2)
