"""Context-parallel collectives as autograd functions: each forward has its gradient's collective
in backward. The group is an argument; nothing here reads global state but `exposed`, the clock of
the time spent blocked in them."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist


class ExposedTime:
    """Seconds this process has spent blocked in context-parallel communication: the blocking
    exchanges whole, a ring hop from its wait (what the block computed meanwhile hid the rest).
    benchmarks/bench_context.py reports it per step as the exposed share."""

    def __init__(self):
        self.seconds = 0.0

    @contextlib.contextmanager
    def blocked(self):
        """Count the time inside as blocked."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start


exposed = ExposedTime()


class _AllToAll(torch.autograd.Function):
    """Split dim 0 into world parts, send part i to rank i, concatenate what arrives along dim 0;
    backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()  # first: empty_like keeps a view's strides, and the collective writes contiguously
    out = torch.empty_like(x)
    with exposed.blocked():
        dist.all_to_all_single(out, x, group=group)
    return out


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Rank i receives every rank's i-th slice of dim 0, in rank order (autograd: the reverse exchange)."""
    return _AllToAll.apply(x, group)


class _RingShift(torch.autograd.Function):
    """Send x to the next rank of the ring, receive the previous rank's; backward sends the
    gradient the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _shift(x.contiguous(), group, +1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _shift(grad.contiguous(), ctx.group, -1), None


def _shift(x: torch.Tensor, group, step: int) -> torch.Tensor:
    x = x.contiguous()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    to = dist.get_global_rank(group, (rank + step) % world)
    source = dist.get_global_rank(group, (rank - step) % world)
    out = torch.empty_like(x)
    with exposed.blocked():
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, to, group),
                                           dist.P2POp(dist.irecv, out, source, group)])
        for request in requests:
            request.wait()
    return out


def ring_shift(x: torch.Tensor, group) -> torch.Tensor:
    """The previous ring rank's x (autograd: the gradient goes back to it)."""
    return _RingShift.apply(x, group)


class _BroadcastFromFirst(torch.autograd.Function):
    """Every rank gets the group's first rank's x; backward sums the ranks' gradients on the first
    rank (the others' x gets zeros)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone().contiguous()
        with exposed.blocked():
            dist.broadcast(out, dist.get_global_rank(group, 0), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        with exposed.blocked():
            dist.all_reduce(grad, group=ctx.group)
        return (grad if dist.get_rank(ctx.group) == 0 else torch.zeros_like(grad)), None


def broadcast_from_first(x: torch.Tensor, group) -> torch.Tensor:
    """The group's first rank's x on every rank (autograd: its x gets the sum of every rank's
    gradient, as each rank uses it in its own share of the loss)."""
    return _BroadcastFromFirst.apply(x, group)
