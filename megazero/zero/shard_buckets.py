"""Stage 3's gradient buckets: gradients of any units, reduce-scattered `reduce_bucket_size` at a time.

Each shard (unit, param group) is laid out by a FlatLayout whose buckets close at
`reduce_bucket_size` elements, so a layer larger than that is reduced in several pieces. Those
pieces, in the order backward produces them (the last layer first, the root unit last), are then
packed into reduce buckets, the same way: a reduce bucket closes at the first piece that brings
it to `reduce_bucket_size` elements. So small layers share one reduce-scatter, as in DeepSpeed.

A reduce bucket's buffer is N rows of C columns (N ranks): row r is the concatenation of rank r's
chunk of each piece, so after the reduce-scatter this rank's row holds its reduced chunk of every
piece, and is added into the shard's gradient partition. A parameter's gradient therefore lands in
the buffer as up to N slices (one per rank whose chunk it spans), precomputed once.

Buckets start strictly in order, as soon as all their gradients have arrived, so every rank issues
the same collectives in the same order. `overlap_comm` true: the reduce-scatter runs while backward
goes on, and a shared InflightLimit bounds the buffers in flight; false: it is waited for at once,
in the hook, before backward continues (synchronous, one bucket buffer at a time).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megazero.zero.averaging import AVERAGE_THEN_SUM, GradientAveraging
from megazero.zero.buckets import InflightLimit
from megazero.zero.collectives import Handle, reduce_scatter_chunks
from megazero.zero.layout import Bucket
from megazero.zero.master_partitions import add_reduced_gradient


@dataclass
class _Piece:
    """One layout bucket of one shard, at `column` inside its reduce bucket's rows."""

    shard: object  # megazero.zero.sharded._Shard
    bucket: Bucket
    column: int


@dataclass
class ReduceBucket:
    """A group of pieces reduced by one reduce-scatter of `rows` x `columns` elements."""

    index: int
    rows: int
    pieces: list[_Piece] = field(default_factory=list)
    columns: int = 0
    params: list[torch.nn.Parameter] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Elements of the whole buffer (all ranks' rows)."""
        return self.rows * self.columns

    def add(self, shard, bucket: Bucket) -> None:
        """Append `bucket` of `shard` (its chunk goes to the next columns of every row)."""
        self.pieces.append(_Piece(shard, bucket, self.columns))
        self.columns += bucket.chunk(self.rows)
        self.params.extend(bucket.params)


def plan_reduce_buckets(shards_in_backward_order: list, bucket_numel: int, world_size: int) -> list[ReduceBucket]:
    """Pack the shards' layout buckets, in order, into reduce buckets of at least `bucket_numel` elements."""
    out: list[ReduceBucket] = []
    current = ReduceBucket(0, world_size)
    for shard in shards_in_backward_order:
        for bucket in shard.layout.buckets:
            current.add(shard, bucket)
            if current.numel >= bucket_numel:
                out.append(current)
                current = ReduceBucket(len(out), world_size)
    if current.pieces:
        out.append(current)
    return out


def _slices(piece: _Piece, param: torch.nn.Parameter, columns: int) -> list[tuple[int, int, int]]:
    """(start in param's flat gradient, numel, start in the bucket buffer) of each rank's part of `param`."""
    layout, bucket = piece.shard.layout, piece.bucket
    chunk = bucket.chunk(layout.world_size)
    begin = layout.offsets[param] - bucket.start
    end = begin + layout.numels[param]
    out = []
    for row in range(layout.world_size):
        lo, hi = max(begin, row * chunk), min(end, (row + 1) * chunk)
        if lo < hi:
            out.append((lo - begin, hi - lo, row * columns + piece.column + lo - row * chunk))
    return out


class ShardedGradients:
    """Collects the gradients of every shard's parameters into reduce buckets and reduce-scatters
    them into the shards' gradient partitions (`shard.grad_views[bucket.index]`); the sums are
    divided by `divisor` in all (None: the group's size)."""

    def __init__(self, shards_in_backward_order: list, bucket_numel: int, group, world_size: int, rank: int,
                 overlap: bool, device, inflight: InflightLimit | None = None,
                 averaging: GradientAveraging = AVERAGE_THEN_SUM, divisor: int | None = None):
        self.group = group
        self.world_size = world_size
        divisor = world_size if divisor is None else divisor  # (expert parameters: the whole DP size)
        self.before, self.after = averaging.before(divisor), averaging.after(divisor)
        self.rank = rank
        self.overlap = overlap
        self.buckets = plan_reduce_buckets(shards_in_backward_order, bucket_numel, world_size)
        self._device = device
        self._inflight = inflight or InflightLimit()
        self._bucket_of: dict[torch.nn.Parameter, ReduceBucket] = {}
        self._slices: dict[torch.nn.Parameter, list[tuple[int, int, int]]] = {}
        for rb in self.buckets:
            for piece in rb.pieces:
                for p in piece.bucket.params:
                    self._bucket_of[p] = rb
                    self._slices[p] = _slices(piece, p, rb.columns)
        self._staging: dict[int, torch.Tensor] = {}
        self._handles: dict[int, Handle] = {}
        self._arrived: dict[int, int] = {}
        self._next_to_launch = 0
        self.launched_in_backward = 0  # this micro-step's reductions started by gradient hooks
        self.peak_in_flight = 0  # most reductions started and not yet finished at one time, this micro-step
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._bucket_of]

    @property
    def bucket_count(self) -> int:
        """Reduce-scatters per micro-step."""
        return len(self.buckets)

    def _buffer(self, rb: ReduceBucket) -> torch.Tensor:
        if rb.index not in self._staging:
            self._staging[rb.index] = self._inflight.acquire(rb.numel, self._device)
        return self._staging[rb.index]

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        rb = self._bucket_of[param]
        buffer, grad = self._buffer(rb), param.grad.reshape(-1)
        for src, numel, dst in self._slices[param]:
            buffer[dst:dst + numel].add_(grad[src:src + numel])
        param.grad = None
        self._arrived[rb.index] = self._arrived.get(rb.index, 0) + 1
        while (self._next_to_launch < len(self.buckets)
               and self._arrived.get(self._next_to_launch, 0) == len(self.buckets[self._next_to_launch].params)):
            self._launch(self.buckets[self._next_to_launch])
            self.launched_in_backward += 1

    def _launch(self, rb: ReduceBucket) -> None:
        buffer = self._buffer(rb)
        if self.before != 1:
            buffer.div_(self.before)  # the rest of the division after the reduction (megazero.zero.averaging)
        inner = reduce_scatter_chunks(buffer, self.group, f"gradient bucket {rb.index}")
        mine = buffer.view(self.world_size, -1)[self.rank]

        def add_into_partitions() -> None:
            if self.after != 1:
                mine.mul_(self.after)
            for piece in rb.pieces:
                chunk = piece.bucket.chunk(self.world_size)
                add_reduced_gradient(piece.shard, piece.bucket.index, mine[piece.column:piece.column + chunk])

        handle = Handle([inner], add_into_partitions)
        self._handles[rb.index] = handle
        self._next_to_launch += 1
        staging = self._staging.pop(rb.index)
        if self.overlap:
            self._inflight.track(handle, staging)
        in_flight = sum(not h.done for h in self._handles.values())
        self.peak_in_flight = max(self.peak_in_flight, in_flight)
        if not self.overlap:
            handle.wait()

    def finish_reduction(self) -> None:
        """Start every bucket not yet started (parameters without gradients reduce zeros), wait for all."""
        while self._next_to_launch < len(self.buckets):
            self._launch(self.buckets[self._next_to_launch])
        for index in sorted(self._handles):
            self._handles[index].wait()
        self._inflight.drain()
        self._handles.clear()
        self._arrived.clear()
        self._staging.clear()
        self._next_to_launch = 0

    def start_micro_step(self) -> None:
        """Reset the per-micro-step counters (launched_in_backward, peak_in_flight)."""
        self.launched_in_backward = 0
        self.peak_in_flight = 0
