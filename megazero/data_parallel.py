"""Data parallelism (ZeRO stage 0): one contiguous fp32 gradient buffer, all-reduced in buckets.

Each parameter's gradient is added into its slice of the buffer by a hook that fires when
autograd has finished accumulating it, and the parameter's own `.grad` is freed. The buffer is
cut into fixed-size buckets in the order gradients usually arrive (reverse of registration);
on the micro-step that ends a gradient-accumulation window, a bucket whose gradients have all
arrived starts its asynchronous all-reduce at once, so communication overlaps the rest of
backward. Buckets are launched strictly in order, so every rank issues the same collectives in
the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class _Bucket:
    start: int
    end: int
    params: list[torch.nn.Parameter]
    work: dist.Work | None = None
    arrived: set = field(default_factory=set)


class GradientBuffer:
    """Accumulates gradients of `params` in fp32 and averages them over `group` in buckets."""

    def __init__(self, params: list[torch.nn.Parameter], group: dist.ProcessGroup | None,
                 bucket_numel: int, overlap: bool = True, dtype: torch.dtype = torch.float32):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.overlap = overlap
        device = self.params[0].device if self.params else torch.device("cpu")
        ordered = list(reversed(self.params))  # backward visits the last layers first
        total = sum(p.numel() for p in ordered)
        self.buffer = torch.zeros(total, dtype=dtype, device=device)
        self.views: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[torch.nn.Parameter, _Bucket] = {}
        offset, bucket_params, bucket_start = 0, [], 0
        for p in ordered:
            self.views[p] = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            bucket_params.append(p)
            if offset - bucket_start >= bucket_numel:
                self._add_bucket(bucket_start, offset, bucket_params)
                bucket_params, bucket_start = [], offset
        if bucket_params:
            self._add_bucket(bucket_start, offset, bucket_params)
        self.sync_this_micro_step = True
        self._next_to_launch = 0
        # parameters whose slice holds a gradient of the current accumulation window; the first
        # gradient of a window is copied in (no separate zeroing pass), later ones are added
        self._written: set[torch.nn.Parameter] = set()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    def _add_bucket(self, start: int, end: int, params: list) -> None:
        bucket = _Bucket(start, end, list(params))
        self.buckets.append(bucket)
        for p in params:
            self._bucket_of[p] = bucket

    def grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The fp32 accumulated gradient of `param` (a view into the buffer)."""
        return self.views[param]

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if param in self._written:
            self.views[param].add_(param.grad)
        else:
            self.views[param].copy_(param.grad)
            self._written.add(param)
        param.grad = None
        if not (self.sync_this_micro_step and self.overlap and self.world_size > 1):
            return
        bucket = self._bucket_of[param]
        bucket.arrived.add(param)
        while (self._next_to_launch < len(self.buckets)
               and len(self.buckets[self._next_to_launch].arrived) == len(self.buckets[self._next_to_launch].params)):
            self._launch(self.buckets[self._next_to_launch])
            self._next_to_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        chunk = self.buffer[bucket.start:bucket.end]
        chunk.div_(self.world_size)  # pre-divide: the sum of averages is the average
        bucket.work = dist.all_reduce(chunk, group=self.group, async_op=True)

    def finish_reduction(self) -> None:
        """Launch any bucket not yet started (e.g. unused parameters) and wait for all of them."""
        if len(self._written) != len(self.params):
            for p in self.params:  # no gradient this window: its slice must read as zero
                if p not in self._written:
                    self.views[p].zero_()
                    self._written.add(p)
        if self.world_size > 1:
            while self._next_to_launch < len(self.buckets):
                self._launch(self.buckets[self._next_to_launch])
                self._next_to_launch += 1
            for bucket in self.buckets:
                if bucket.work is not None:
                    bucket.work.wait()
        self._reset_buckets()

    def _reset_buckets(self) -> None:
        for bucket in self.buckets:
            bucket.work = None
            bucket.arrived.clear()
        self._next_to_launch = 0

    def zero(self) -> None:
        """Start a new accumulation window (after a step, or a skipped one): the slices are
        overwritten by the next gradients rather than cleared now."""
        self._written.clear()
        self._reset_buckets()

    @property
    def bucket_count(self) -> int:
        """How many buckets the buffer is cut into."""
        return len(self.buckets)
