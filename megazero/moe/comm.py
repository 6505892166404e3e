"""Collectives over the expert-parallel group, as autograd functions where gradients cross them.

    all_to_all(x, output_splits, input_splits, group)   forward: all_to_all_single with variable
                                                         splits; backward: the reverse all-to-all
    all_reduce_sum(x, group)                             forward: sum over the group; backward: sum
                                                         of the gradients over the group
    all_gather_counts(counts, group)                     [EP, ...] of every rank's counts (no grad)

`all_reduce_sum`'s backward is a sum, not the identity: every rank adds the same reduced value to
its own loss (e.g. the load-balancing loss of the whole EP group's tokens), so the gradient of the
sum of the ranks' losses with respect to one rank's contribution is the sum of their gradients.
Every function is the identity (or a plain copy) when the group is None or has one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Ranks in `group` (1 for None or without an initialised process group)."""
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def group_rank(group) -> int:
    """This process's rank in `group` (0 for None or without an initialised process group)."""
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        # the gradient of each received row goes back to the rank (and row) it came from
        return _all_to_all(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows [sum(input_splits[:j]), +input_splits[j]) of x go to rank j of `group`; returns the rows
    received, rank 0's first (output_splits[i] rows from rank i). Differentiable."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()  # never sum into the caller's tensor
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of x over `group`, with the gradients summed over the group in backward (see the module
    docstring for why)."""
    if group_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)


def all_gather_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `counts` stacked in rank order: [EP, *counts.shape] (integers, no gradient)."""
    if group_size(group) == 1:
        return counts.unsqueeze(0)
    parts = [torch.empty_like(counts) for _ in range(group_size(group))]
    dist.all_gather(parts, counts.contiguous(), group=group)
    return torch.stack(parts)
