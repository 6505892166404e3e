"""Tensor-parallel communication as autograd functions (Megatron's mappings).

Each forward collective has the matching backward collective:

    copy_to_tensor_parallel_region        forward: identity        backward: all-reduce
    reduce_from_tensor_parallel_region    forward: all-reduce      backward: identity
    scatter_to_tensor_parallel_region     forward: split last dim  backward: all-gather last dim
    gather_from_tensor_parallel_region    forward: all-gather last backward: split last dim

and for sequence parallelism, along the sequence dimension (dim 1 of [batch, seq, hidden]):

    scatter_to_sequence_parallel_region         forward: split        backward: all-gather
    gather_from_sequence_parallel_region        forward: all-gather   backward: reduce-scatter
    reduce_scatter_to_sequence_parallel_region  forward: reduce-scatter backward: all-gather

`sync_replicated_grad(param, group)` marks a parameter that every TP rank holds whole but applies
to a different part of the sequence (LayerNorm and bias under sequence parallelism): identity
forward, gradient all-reduced over the group in backward. Every function is the identity when
the group has one rank. The groups are arguments; nothing here reads global state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SEQUENCE_DIM = 1


def _world(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _world(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the tensor-parallel size "
                         f"{world}")
    return x.chunk(world, dim=dim)[dist.get_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the tensor-parallel size "
                         f"{world}")
    stacked = torch.stack(x.chunk(world, dim=dim)).contiguous()  # [world, ...chunk]
    out = torch.empty_like(stacked[0])
    dist.reduce_scatter_single(out.view(-1), stacked.view(-1), group=group)
    return out


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, reduce_scatter_grad):
        ctx.dim, ctx.group, ctx.reduce_scatter_grad = dim, group, reduce_scatter_grad
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_scatter_grad:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Identity; the gradient is summed over the group (input of a column-parallel layer)."""
    return _Copy.apply(x, group) if _world(group) > 1 else x


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group; the gradient passes through (output of a row-parallel layer)."""
    return _Reduce.apply(x, group) if _world(group) > 1 else x


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of the last dimension."""
    return _Scatter.apply(x, -1, group) if _world(group) > 1 else x


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's x along the last dimension."""
    return _Gather.apply(x, -1, group, False) if _world(group) > 1 else x


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of the sequence."""
    return _Scatter.apply(x, SEQUENCE_DIM, group) if _world(group) > 1 else x


def gather_from_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence from every rank's slice; the gradient is reduce-scattered back."""
    return _Gather.apply(x, SEQUENCE_DIM, group, True) if _world(group) > 1 else x


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group, each rank keeping its slice of the sequence."""
    return _ReduceScatter.apply(x, SEQUENCE_DIM, group) if _world(group) > 1 else x


def sync_replicated_grad(param: torch.Tensor, group) -> torch.Tensor:
    """`param` unchanged; its gradient is summed over the group (sequence-parallel LayerNorm/bias)."""
    return _Copy.apply(param, group) if _world(group) > 1 else param
