"""Cutting a full tensor into tensor-parallel shards and putting shards back together.

A tensor-parallel weight is split along `partition_dim`. With `stride` s > 1 the dimension is
first seen as s equal blocks (e.g. the query, key and value rows of a fused QKV weight) and each
block is split into world-size pieces; rank r holds piece r of every block. So the TP=1 layout
of a fused weight stays the plain one, and rank r's shard is exactly its heads' rows.
"""

from __future__ import annotations

import torch


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """numerator / denominator, which must divide exactly."""
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def shard_of(full: torch.Tensor, dim: int, world_size: int, rank: int, stride: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of `full` (a copy)."""
    blocks = full.chunk(stride, dim=dim) if stride > 1 else (full,)
    for block in blocks:
        divide(block.shape[dim], world_size, f"dimension {dim} of size")
    return torch.cat([block.chunk(world_size, dim=dim)[rank] for block in blocks], dim=dim).clone()


def merge_shards(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of shard_of over all ranks' shards, in rank order."""
    per_rank = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([per_rank[r][b] for b in range(stride) for r in range(len(shards))], dim=dim)


def set_tensor_parallel_attributes(param: torch.Tensor, partition_dim: int, stride: int = 1) -> None:
    """Mark `param` as split across tensor-parallel ranks (for checkpoints, norms and reshaping)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def partition_of(param: torch.Tensor) -> tuple[int | None, int]:
    """(partition dimension, stride) of a tensor-parallel parameter; (None, 1) for one every rank holds whole."""
    if not is_tensor_parallel(param):
        return None, 1
    return param.partition_dim, param.partition_stride


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True when `param` is a shard (each TP rank holds a different piece)."""
    return bool(getattr(param, "tensor_model_parallel", False))
