"""Tensor-parallel layers (Megatron's column/row parallel linear and vocab-parallel embedding).

A column-parallel Linear holds rows [r*out/N, (r+1)*out/N) of the weight (a slice of the output
features); a row-parallel one holds the matching columns (a slice of the input features), so an
MLP or attention block is column-parallel -> local nonlinearity -> row-parallel with a single
all-reduce in forward and one in backward. With `sequence_parallel`, the activations between
blocks are split along the sequence instead of replicated: the column-parallel layer all-gathers
its input and the row-parallel layer reduce-scatters its output.

Initialisation: each layer builds the full weight with `init_method` from the default generator
(seeded identically on every TP rank) and keeps its shard, so with the same seed rank r's shard is
exactly the slice of the TP=1 weight, and every layout starts from the same model.
With a group of one rank (or none) these are plain Linear/Embedding/LayerNorm layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megazero.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
    sync_replicated_grad,
)
from megazero.tensor_parallel.utils import divide, set_tensor_parallel_attributes, shard_of
from megazero.tensor_parallel.weight_grad import linear

InitMethod = Callable[[torch.Tensor], object]


def _rank_and_world(group) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _sharded_parameter(shape: tuple[int, ...], init_method: InitMethod, partition_dim: int, group,
                       stride: int = 1) -> nn.Parameter:
    """Build the full tensor with init_method, keep this rank's shard (marked tensor-parallel)."""
    rank, world = _rank_and_world(group)
    full = torch.empty(shape)
    with torch.no_grad():
        init_method(full)
    param = nn.Parameter(shard_of(full, partition_dim, world, rank, stride) if world > 1 else full)
    set_tensor_parallel_attributes(param, partition_dim, stride)
    return param


def _zeros(t: torch.Tensor) -> None:
    nn.init.zeros_(t)


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split along its output features (rows) across the TP group.

    gather_output: all-gather the output slices so every rank holds the whole y (otherwise the
    output stays split, as a row-parallel layer expects). stride: the output is `stride` blocks
    (e.g. 3 for fused Q, K, V), each split across ranks.
    """

    def __init__(self, in_features: int, out_features: int, tp_group=None, bias: bool = True,
                 gather_output: bool = False, init_method: InitMethod = nn.init.xavier_normal_, stride: int = 1,
                 sequence_parallel: bool = False):
        super().__init__()
        _, world = _rank_and_world(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.output_size_per_partition = divide(out_features, world, "out_features")
        self.tp_group, self.gather_output, self.sequence_parallel = tp_group, gather_output, sequence_parallel
        self.stride = stride
        self.weight = _sharded_parameter((out_features, in_features), init_method, 0, tp_group, stride)
        self.bias = _sharded_parameter((out_features,), _zeros, 0, tp_group, stride) if bias else None

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """add_bias=False leaves the bias to the caller (e.g. a fused bias + GeLU)."""
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = copy_to_tensor_parallel_region(x, self.tp_group)
        y = linear(x, self.weight, self.bias if add_bias else None)
        if not self.gather_output:
            return y
        y = gather_from_tensor_parallel_region(y, self.tp_group)  # [..., rank, stride block, piece]
        if self.stride > 1:  # back to the dense order [..., stride block, rank, piece]
            world = y.shape[-1] // self.output_size_per_partition
            y = y.unflatten(-1, (world, self.stride, -1)).transpose(-3, -2).flatten(-3)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (local {self.weight.shape[0]})"


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split along its input features (columns) across the TP group.

    input_is_parallel: x is already this rank's slice of the input features (the output of a
    column-parallel layer); otherwise it is split here. The partial products are summed over the
    group (reduce-scattered along the sequence under sequence parallelism); the bias is added once.
    """

    def __init__(self, in_features: int, out_features: int, tp_group=None, bias: bool = True,
                 input_is_parallel: bool = True, init_method: InitMethod = nn.init.xavier_normal_,
                 sequence_parallel: bool = False):
        super().__init__()
        _, world = _rank_and_world(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.input_size_per_partition = divide(in_features, world, "in_features")
        self.tp_group, self.input_is_parallel, self.sequence_parallel = tp_group, input_is_parallel, sequence_parallel
        self.weight = _sharded_parameter((out_features, in_features), init_method, 1, tp_group)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.tp_group)
        y = linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp_group)
        if self.bias is None:
            return y
        return y + (sync_replicated_grad(self.bias, self.tp_group) if self.sequence_parallel else self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split across the TP group: rank r holds rows
    [r*V/N, (r+1)*V/N); each rank looks up the ids in its range and the results are summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group=None,
                 init_method: InitMethod = nn.init.normal_):
        super().__init__()
        rank, world = _rank_and_world(tp_group)
        self.num_embeddings, self.embedding_dim, self.tp_group = num_embeddings, embedding_dim, tp_group
        per_rank = divide(num_embeddings, world, "num_embeddings (the padded vocabulary)")
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.weight = _sharded_parameter((num_embeddings, embedding_dim), init_method, 0, tp_group)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_end - self.vocab_start == self.num_embeddings:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} (local rows {self.vocab_start}:{self.vocab_end})"


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose parameter gradients are summed over the TP group when the activations
    are split along the sequence (each rank then sees only part of the tokens)."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, tp_group=None, sequence_parallel: bool = False,
                 fused: bool = False):
        super().__init__(normalized_shape, eps=eps)
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and _rank_and_world(tp_group)[1] > 1
        self.fused = fused  # megazero's CUDA kernel on GPUs (where it is built)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            if self.fused and x.is_cuda:
                from megazero.ops.cuda_ops import layer_norm

                return layer_norm(x, self.weight, self.bias, self.eps)
            return super().forward(x)
        return F.layer_norm(x, self.normalized_shape, sync_replicated_grad(self.weight, self.tp_group),
                            sync_replicated_grad(self.bias, self.tp_group), self.eps)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (x / rms(x) * weight, no bias or centring) whose weight gradient is summed over
    the TP group when the activations are split along the sequence, as LayerNorm's."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, tp_group=None, sequence_parallel: bool = False,
                 fused: bool = False):
        super().__init__(normalized_shape, eps=eps)
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and _rank_and_world(tp_group)[1] > 1
        self.fused = fused  # megazero's fused RMSNorm: the CUDA kernel on GPUs, the CPU op on CPUs (where built)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = sync_replicated_grad(self.weight, self.tp_group) if self.sequence_parallel else self.weight
        if self.fused:
            from megazero.ops import cpu_norms, cuda_ops

            return (cuda_ops if x.is_cuda else cpu_norms).rms_norm(x, weight, self.eps)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class ReplicatedLinear(nn.Module):
    """y = x A^T (+ b) with A whole on every TP rank, inside a tensor-parallel region: each rank
    uses a different part of y (e.g. the key/value heads its query heads read, when the heads do
    not split over the ranks), so the gradients of A and of x are summed over the group.

    Its input is that of a column-parallel layer: replicated (or split along the sequence under
    sequence parallelism, then all-gathered here). A is initialised from the default generator
    like every layer, so it equals the TP=1 weight; it is not marked tensor-parallel (checkpoints
    keep one copy).
    """

    def __init__(self, in_features: int, out_features: int, tp_group=None, bias: bool = True,
                 init_method: InitMethod = nn.init.xavier_normal_, sequence_parallel: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        with torch.no_grad():
            init_method(self.weight)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = copy_to_tensor_parallel_region(x, self.tp_group)
        bias = sync_replicated_grad(self.bias, self.tp_group) if self.bias is not None else None
        return F.linear(x, sync_replicated_grad(self.weight, self.tp_group), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (whole on every rank)"
