"""Gradient hooks and buckets: gradients land in fp32 bucket buffers and each full bucket starts its
reduction (all-reduce or reduce-scatter) at once, so communication overlaps the rest of backward.

A hook fires when autograd has finished accumulating a parameter's gradient; it adds the
gradient into the parameter's slice of its bucket buffer and frees `.grad`. On a micro-step that
communicates, a bucket whose gradients have all arrived is handed to `reduce_bucket`, strictly in
bucket order, so every rank issues the same collectives in the same order.

Buffers are either one contiguous buffer for the whole layout, which keeps accumulating across
micro-steps (stages 0 and 1), or `staged`: a bucket-sized buffer borrowed per bucket and returned
once its reduction is done, so no rank ever holds the whole gradient (stage 2).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megazero.zero.averaging import SUM_THEN_AVERAGE, GradientAveraging
from megazero.zero.collectives import Handle
from megazero.zero.layout import Bucket, FlatLayout


class InflightLimit:
    """Bounds the staging buffers of launched reductions: before a new buffer is taken while
    `limit` are in flight, the oldest reduction is waited for and its buffer dropped. Shared by
    all the bucket sets of a model, so staging memory stays at about (limit + open buckets) x
    bucket size however many buckets there are."""

    def __init__(self, limit: int = 2):
        self.limit = limit
        self._inflight: list[tuple[Handle, torch.Tensor]] = []

    def acquire(self, numel: int, device) -> torch.Tensor:
        """A zeroed fp32 staging buffer of `numel` elements."""
        while len(self._inflight) >= self.limit:
            handle, _ = self._inflight.pop(0)
            handle.wait()
        return torch.zeros(numel, dtype=torch.float32, device=device)

    def track(self, handle: Handle, buffer: torch.Tensor) -> None:
        """`buffer` is busy until `handle` completes."""
        self._inflight.append((handle, buffer))

    def drain(self) -> None:
        """Wait for everything in flight."""
        while self._inflight:
            handle, _ = self._inflight.pop(0)
            handle.wait()


class BucketedGradients:
    """Collects gradients of `layout.params` into buckets and reduces them with `reduce_bucket`.

    reduce_bucket(bucket, tensor) -> Handle is called with the bucket's fp32 buffer (bucket.numel
    elements). The summed gradients are divided by `divisor` in all: the data-parallel size, unless
    given (expert parameters reduced over the expert-data-parallel group still divide by the whole
    data-parallel size, see megazero.zero.expert_parallel). `averaging` splits that division into
    `before`, applied here, and `after`, which reduce_bucket applies to what it reduced before it is
    used (megazero.zero.averaging).
    """

    def __init__(self, layout: FlatLayout, reduce_bucket: Callable[[Bucket, torch.Tensor], Handle],
                 world_size: int, overlap: bool = True, staged: bool = False, device=None,
                 inflight: InflightLimit | None = None, divisor: int | None = None,
                 averaging: GradientAveraging = SUM_THEN_AVERAGE):
        self.layout = layout
        self.reduce_bucket = reduce_bucket
        self.world_size = world_size
        self.divisor = world_size if divisor is None else divisor
        self.before = averaging.before(self.divisor)
        self.after = averaging.after(self.divisor)
        self.overlap = overlap
        self.staged = staged
        device = device or (layout.params[0].device if layout.params else torch.device("cpu"))
        self.buffer = None if staged else torch.zeros(layout.numel, dtype=torch.float32, device=device)
        self._device = device
        self._inflight = inflight or InflightLimit()
        self._staging: dict[int, torch.Tensor] = {}  # bucket index -> its buffer this micro-step
        self._handles: dict[int, Handle] = {}
        self._arrived: dict[int, int] = {}
        self._written: set[torch.nn.Parameter] = set()
        self._next_to_launch = 0
        self.sync_this_micro_step = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in layout.params]

    @property
    def bucket_count(self) -> int:
        """How many buckets the layout is cut into."""
        return len(self.layout.buckets)

    def bucket_tensor(self, bucket: Bucket) -> torch.Tensor:
        """The fp32 buffer of `bucket` (a view of the full buffer, or its staging buffer)."""
        if not self.staged:
            return self.buffer[bucket.start:bucket.start + bucket.numel]
        if bucket.index not in self._staging:
            self._staging[bucket.index] = self._inflight.acquire(bucket.numel, self._device)
        return self._staging[bucket.index]

    def grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The accumulated fp32 gradient of `param` (full-buffer layouts only)."""
        offset = self.layout.offsets[param]
        return self.buffer[offset:offset + self.layout.numels[param]].view(self.layout.shapes[param])

    def _slot(self, param: torch.nn.Parameter) -> torch.Tensor:
        bucket = self.layout.bucket_of[param]
        start = self.layout.offsets[param] - bucket.start
        return self.bucket_tensor(bucket)[start:start + self.layout.numels[param]].view(self.layout.shapes[param])

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        slot = self._slot(param)
        if self.staged or param in self._written:
            slot.add_(param.grad)
        else:  # first gradient of the window: overwrite, so the buffer needs no zeroing pass
            slot.copy_(param.grad)
            self._written.add(param)
        param.grad = None
        if not (self.sync_this_micro_step and self.overlap and max(self.world_size, self.divisor) > 1):
            return
        bucket = self.layout.bucket_of[param]
        self._arrived[bucket.index] = self._arrived.get(bucket.index, 0) + 1
        buckets = self.layout.buckets
        while (self._next_to_launch < len(buckets)
               and self._arrived.get(self._next_to_launch, 0) == len(buckets[self._next_to_launch].params)):
            self._launch(buckets[self._next_to_launch])

    def _launch(self, bucket: Bucket) -> None:
        tensor = self.bucket_tensor(bucket)
        if self.before != 1:
            tensor.div_(self.before)
        self._handles[bucket.index] = self.reduce_bucket(bucket, tensor)
        if self.staged:
            self._inflight.track(self._handles[bucket.index], self._staging.pop(bucket.index))
        self._next_to_launch += 1

    def _zero_missing(self) -> None:
        """Parameters that got no gradient this window must read as zero."""
        for p in self.layout.params:
            if p not in self._written:
                self._slot(p).zero_()
                self._written.add(p)

    def finish_reduction(self) -> None:
        """Reduce every bucket not yet started and wait for all of them (a communicating micro-step)."""
        if not self.staged:
            self._zero_missing()
        while self._next_to_launch < len(self.layout.buckets):
            self._launch(self.layout.buckets[self._next_to_launch])
        for index in sorted(self._handles):
            self._handles[index].wait()
        self._handles.clear()
        self._arrived.clear()
        self._next_to_launch = 0
        if self.staged:
            self._inflight.drain()
            self._staging.clear()

    def finish_local(self) -> None:
        """End a window whose gradients stay on this rank (an optimizer that averages over the group
        itself, megazero.optim.protocol.DataParallelAverager): nothing is reduced or divided."""
        self._zero_missing()

    def start_window(self) -> None:
        """After an optimizer step (or a skipped one): the next gradients start a new accumulation window."""
        self._written.clear()
        self._handles.clear()
        self._arrived.clear()
        self._next_to_launch = 0
