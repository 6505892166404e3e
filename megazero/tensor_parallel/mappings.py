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

from megazero.compat import reduce_scatter_single

SEQUENCE_DIM = 1


def _world(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _identity(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x


def _all_reduce(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    x = x.clone()  # never sum into the caller's tensor
    dist.all_reduce(x, group=group)
    return x


def _chunks(x: torch.Tensor, dim: int, world: int) -> tuple[torch.Tensor, ...]:
    if x.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the tensor-parallel size "
                         f"{world}")
    return x.chunk(world, dim=dim)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return _chunks(x, dim, _world(group))[dist.get_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_world(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    stacked = torch.stack(_chunks(x, dim, _world(group))).contiguous()  # [world, ...chunk]
    out = torch.empty_like(stacked[0])
    reduce_scatter_single(out.view(-1), stacked.view(-1), group=group)
    return out


class _Mapping(torch.autograd.Function):
    """`forward(x, dim, group)` in forward and `backward(grad, dim, group)` in backward: every
    mapping below is one such pair of collectives."""

    @staticmethod
    def forward(ctx, x, forward, backward, dim, group):
        ctx.backward_fn, ctx.dim, ctx.group = backward, dim, group
        return forward(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad.contiguous(), ctx.dim, ctx.group), None, None, None, None


def _apply(x: torch.Tensor, forward, backward, dim: int, group) -> torch.Tensor:
    return _Mapping.apply(x, forward, backward, dim, group) if _world(group) > 1 else x


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Identity; the gradient is summed over the group (input of a column-parallel layer)."""
    return _apply(x, _identity, _all_reduce, -1, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group; the gradient passes through (output of a row-parallel layer)."""
    return _apply(x, _all_reduce, _identity, -1, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of the last dimension."""
    return _apply(x, _split, _gather, -1, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's x along the last dimension."""
    return _apply(x, _gather, _split, -1, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of the sequence."""
    return _apply(x, _split, _gather, SEQUENCE_DIM, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence from every rank's slice; the gradient is reduce-scattered back."""
    return _apply(x, _gather, _reduce_scatter, SEQUENCE_DIM, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group, each rank keeping its slice of the sequence."""
    return _apply(x, _reduce_scatter, _gather, SEQUENCE_DIM, group)


def sync_replicated_grad(param: torch.Tensor, group) -> torch.Tensor:
    """`param` unchanged; its gradient is summed over the group (sequence-parallel LayerNorm/bias)."""
    return _apply(param, _identity, _all_reduce, -1, group)
