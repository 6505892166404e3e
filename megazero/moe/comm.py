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

`ALL_TO_ALL_TIMER` (off by default; benchmarks/bench_moe.py turns it on) adds up the wall time of
each all-to-all by name ("dispatch", "combine") and direction (forward, "<name>_backward"); when
off it costs one attribute test per call.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Ranks in `group` (1 for None or without an initialised process group)."""
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def group_rank(group) -> int:
    """This process's rank in `group` (0 for None or without an initialised process group)."""
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


class AllToAllTimer:
    """Seconds spent in the all-to-alls, by name (see the module docstring); off until `enabled`."""

    def __init__(self):
        self.enabled = False
        self.seconds: dict[str, float] = {}

    def reset(self) -> None:
        """Forget the times added so far."""
        self.seconds = {}

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` under `name`."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


ALL_TO_ALL_TIMER = AllToAllTimer()


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group,
                name: str) -> torch.Tensor:
    timed = ALL_TO_ALL_TIMER.enabled
    if timed:
        if x.is_cuda:  # the time of this exchange only, not of the kernels queued before it
            torch.cuda.synchronize()
        start = time.perf_counter()
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group)
    if timed:
        if out.is_cuda:
            torch.cuda.synchronize()
        ALL_TO_ALL_TIMER.add(name, time.perf_counter() - start)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, name):
        ctx.output_splits, ctx.input_splits, ctx.group, ctx.name = output_splits, input_splits, group, name
        return _all_to_all(x, output_splits, input_splits, group, name)

    @staticmethod
    def backward(ctx, grad):
        # the gradient of each received row goes back to the rank (and row) it came from
        return (_all_to_all(grad, ctx.input_splits, ctx.output_splits, ctx.group, ctx.name + "_backward"),
                None, None, None, None)


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group,
               name: str = "all_to_all") -> torch.Tensor:
    """Rows [sum(input_splits[:j]), +input_splits[j]) of x go to rank j of `group`; returns the rows
    received, rank 0's first (output_splits[i] rows from rank i). Differentiable. `name`: what
    ALL_TO_ALL_TIMER counts its time under."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group, name)


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
