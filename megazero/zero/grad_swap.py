"""Reduced fp32 gradient partitions in swap files (ZeRO-Infinity's gradient swap), for optimizer
offload to NVMe at stages 2 and 3 (megazero.zero.offload).

As each bucket's reduce-scatter completes, this rank's reduced chunk of every layout bucket in it
(one master chunk's gradient) is added into a bounded pool of aligned host buffers and written to
the swap file of the optimizer sub-group that steps it, at the chunk's (block-aligned) offset, by
the asynchronous I/O op: no rank holds its gradient partition. Within an accumulation window the
first chunk of a window is 0 + reduced (the in-memory partition starts zeroed: the same bits), a
later one read-add-written. Before a chunk leaves memory its squared L2 norm is taken (the fused
kernel of the in-memory norm, on the same values) and, when it is not finite, the parameters with
an inf or nan in it are noted: grad_norm() and nonfinite_params() then answer from those, as the
in-memory state would, without reading anything back (counted slices under model parallelism, and
tied weights' sync_grads, read the chunks back). The optimizer step reads each sub-group's chunks
next to its masters and moments (OffloadedState.step).

The partitions themselves are placeholders on the meta device: they keep their sizes (the
sub-groups are cut by them), hold no memory, and any in-memory use of them fails loudly.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict

import torch
import torch.distributed as dist

from megazero.distributed import all_reduce_sum
from megazero.zero.master_partitions import squared_norm

ALIGN_ELEMENTS = 1024  # 4 KiB of fp32: every chunk's region of a gradient file stays block-aligned


def _padded(numel: int) -> int:
    return -(-numel // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def drop_grad_partition(part) -> None:
    """Replace `part`'s gradient partition by placeholders of the same sizes holding no memory
    (meta-device views: an in-memory read or write of them raises)."""
    placeholder = torch.empty(part.layout.partition_numel, dtype=torch.float32, device="meta")
    part.grad_views = part.layout.split_partition(placeholder)
    part.grad_partition = torch.empty(0, dtype=torch.float32)


def _fragments_by_view(part) -> list[list[tuple[int, int, torch.nn.Parameter]]]:
    """Per gradient view of `part`: (start, numel, parameter) of the parameter pieces in it."""
    offsets = [b.partition_offset for b in part.layout.buckets]
    out: list[list] = [[] for _ in offsets]
    for frag in part.layout.fragments(part.rank):
        view = bisect.bisect_right(offsets, frag.partition_start) - 1
        out[view].append((frag.partition_start - offsets[view], frag.numel, frag.param))
    return out


class GradSwapper:
    """One rank's reduced gradient chunks in the swap files of the optimizer's sub-groups (one file
    per sub-group, chunk after chunk, each at a block-aligned offset); see the module docstring."""

    def __init__(self, files, groups: list, parts: list, buffer_count: int):
        self.files = files
        self.parts = parts
        self.limit = max(1, buffer_count)  # write buffers in flight
        self._where: dict[tuple[int, int], tuple[object, int]] = {}  # (id(part), j) -> (sub-group, byte offset)
        for sg in groups:
            sg.grad_name = f"gradients{sg.index:05d}"
            sg.grad_offsets, total = [], 0
            for part, j, numel in zip(sg.parts, sg.chunks, sg.numels):
                sg.grad_offsets.append(total)
                self._where[(id(part), j)] = (sg, 4 * total)
                total += _padded(numel)
            sg.grad_padded = total
        self.chunk_numel = max((n for sg in groups for n in sg.numels), default=0)
        self._fragments = {id(part): _fragments_by_view(part) for part in parts}
        self._written: set[tuple[int, int]] = set()  # chunks holding this window's gradient
        self._norms: dict[tuple[int, int], float] = {}
        self._nonfinite: dict[tuple[int, int], list[torch.nn.Parameter]] = {}
        self._pending: OrderedDict[tuple[int, int], tuple[int, torch.Tensor]] = OrderedDict()
        self._pool: list[torch.Tensor] = []  # every write buffer made (at most `limit`)
        self._free: list[torch.Tensor] = []
        self.factors: list[float] = []  # scale_gradients() factors, applied as each sub-group is read
        self.reads_for_accumulation = 0

    # ---- writing, as each reduce-scatter completes -----------------------------------------------
    def _buffer(self) -> torch.Tensor:
        if self._free:
            return self._free.pop()
        if len(self._pool) < self.limit:
            from megazero.ops.aio import aligned_empty

            self._pool.append(aligned_empty((self.chunk_numel,), torch.float32))
            return self._pool[-1]
        key = next(iter(self._pending))  # the oldest write: its buffer is reused
        self._finish(key)
        return self._free.pop()

    def _finish(self, key: tuple[int, int]) -> None:
        request, buffer = self._pending.pop(key)
        self.files.wait(request)
        self._free.append(buffer)

    def _read(self, part, j: int, into: torch.Tensor) -> None:
        """Read chunk j of `part` (this window's value) into `into`, waited for."""
        key = (id(part), j)
        if key in self._pending:  # its write must land first
            self._finish(key)
        sg, offset = self._where[key]
        self.files.wait(self.files.submit_read_part(sg.grad_name, into, offset))

    def add(self, part, j: int, reduced: torch.Tensor) -> None:
        """Add this rank's reduced chunk `reduced` of layout bucket j of `part` into its gradient
        (what grad_views[j].add_(reduced) does in memory), take its norm, write it out."""
        key = (id(part), j)
        whole = self._buffer()
        buffer = whole[:reduced.numel()]
        if key in self._written:  # accumulation: read, add, write
            self._read(part, j, buffer)
            self.reads_for_accumulation += 1
        else:  # the window's first: onto zeros, as the zeroed in-memory partition
            buffer.zero_()
        buffer.add_(reduced)
        self._note(part, j, buffer)
        sg, offset = self._where[key]
        self._pending[key] = (self.files.submit_write_part(sg.grad_name, buffer, offset, 4 * sg.grad_padded), whole)
        self._written.add(key)

    def _note(self, part, j: int, chunk: torch.Tensor) -> None:
        """Remember `chunk`'s squared norm and, if it is not finite, the parameters with an inf or nan."""
        key = (id(part), j)
        self._norms[key] = norm = squared_norm(chunk)
        self._nonfinite.pop(key, None)
        if not norm < float("inf"):  # inf or nan (or an overflow of finite values: the check below decides)
            found = [param for start, numel, param in self._fragments[id(part)][j]
                     if not bool(torch.isfinite(chunk[start:start + numel]).all())]
            if found:
                self._nonfinite[key] = found

    def flush(self) -> None:
        """Wait for every write in flight (before the step reads the chunks)."""
        while self._pending:
            self._finish(next(iter(self._pending)))

    def start_window(self) -> None:
        """The next gradients start a new accumulation window (every chunk reads as zero)."""
        self.flush()
        self._written.clear()
        self._norms.clear()
        self._nonfinite.clear()
        self.factors = []

    # ---- what the step needs ---------------------------------------------------------------------
    def submit_reads(self, sg, buffer: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
        """Start reading `sg`'s gradient chunks into `buffer` (sg.grad_padded elements at least);
        (each chunk's view of `buffer`, the requests). A chunk not written this window is zero."""
        views, requests = [], []
        for part, j, numel, offset in zip(sg.parts, sg.chunks, sg.numels, sg.grad_offsets):
            view = buffer[offset:offset + numel]
            views.append(view)
            key = (id(part), j)
            if key in self._written:
                if key in self._pending:
                    self._finish(key)
                requests.append(self.files.submit_read_part(sg.grad_name, view, 4 * offset))
            else:
                view.zero_()
        return views, requests

    def norm_squared(self, group, counted=None) -> torch.Tensor:
        """grad_norm_squared of the in-memory state (megazero.zero.master_partitions), from the norms
        taken as the chunks were written: the same sums in the same order, so the same bits."""
        from megazero.zero.master_partitions import counted_slices

        total = 0.0
        for part in self.parts:
            if counted is None:
                total += sum(self._norms.get((id(part), j), 0.0) for j in range(len(part.grad_views)))
                continue
            chunk = torch.empty(self.chunk_numel, dtype=torch.float32)
            for view, start, numel in counted_slices(part, counted):
                if (id(part), view) in self._written:  # (a chunk not written is zero: adds 0.0)
                    self._read(part, view, chunk[:part.grad_views[view].numel()])
                    total += sum([squared_norm(chunk[start:start + numel])])  # as SquaredNormSum.add
        return all_reduce_sum(torch.tensor(total, dtype=torch.float64), group=group)

    def nonfinite_params(self) -> list[torch.nn.Parameter]:
        """The parameters with an inf or nan in this rank's reduced gradient chunks (in-memory order)."""
        return [p for part in self.parts for j in range(len(part.grad_views))
                for p in self._nonfinite.get((id(part), j), [])]

    def sync_grads(self, params: list[torch.nn.Parameter], group) -> None:
        """Sum the chunks of `params` over `group` (tied weights on other pipeline stages): each is
        read, all-reduced, noted and written back."""
        wanted = {id(p) for p in params}
        chunk = torch.empty(0)
        for part in self.parts:
            if not any(id(p) in wanted for p in part.layout.params):
                continue
            if len(part.layout.params) != 1:
                raise RuntimeError("a tied parameter shares its ZeRO layout with others: build the state "
                                   "with isolate=[tied parameters]")
            for j, view in enumerate(part.grad_views):
                if chunk.numel() < view.numel():
                    from megazero.ops.aio import aligned_empty

                    chunk = aligned_empty((self.chunk_numel,), torch.float32)
                g = chunk[:view.numel()]
                if (id(part), j) in self._written:
                    self._read(part, j, g)
                else:
                    g.zero_()
                dist.all_reduce(g, group=group)
                self._note(part, j, g)
                sg, offset = self._where[(id(part), j)]
                self.files.wait(self.files.submit_write_part(sg.grad_name, g, offset, 4 * sg.grad_padded))
                self._written.add((id(part), j))

    def buffers(self) -> list[torch.Tensor]:
        """The write buffers (for memory reports)."""
        return list(self._pool)
