"""Reduced fp32 gradient partitions in swap files (ZeRO-Infinity's gradient swap), for optimizer
offload to NVMe at stages 2 and 3 (megazero.zero.offload).

As each bucket's reduce-scatter completes, this rank's reduced chunk of every layout bucket in it
(one master chunk's gradient) is added into a ring of host memory (`_ChunkRing`: buffer_count x the
largest chunk, chunks packed one after another, the oldest evicted first) and, when the ring needs
its place, written to the swap file of the optimizer sub-group that steps it, at the chunk's
(block-aligned) offset, by the asynchronous I/O op: no rank holds its gradient partition. A chunk
still in the ring at the step is used from there: the last chunks reduced (the first layers', which
the step takes first) are neither written nor read back, and a partition that fits in the ring is
never written at all. So that an eviction finds its write done (not stalling backward), the oldest
chunks are written ahead once more than half the ring (or, when the partition is only a little
larger than the ring, more than a pass over it will evict) is unwritten.
Within an accumulation window the first chunk of a window is 0 + reduced (the in-memory partition
starts zeroed: the same bits), a later one added where it is (an evicted one read, added and
written back in a scratch chunk, leaving the ring as it is).
Before a chunk can leave memory its squared L2 norm is taken (the fused kernel of the in-memory
norm, on the same values) and, when it is not finite, the parameters with an inf or nan in it are
noted: grad_norm() and nonfinite_params() then answer from those, as the in-memory state would,
without reading anything back (counted slices under model parallelism, and tied weights'
sync_grads, read the chunks). The optimizer step reads each sub-group's chunks not in the ring next
to its masters and moments (OffloadedState.step).

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


class _ChunkRing:
    """Chunks of fp32 placed one after another in one aligned buffer of `numel` elements (each at a
    4 KiB boundary), a chunk that does not fit before the end starting again at 0: placing one
    evicts the oldest chunks until there is room (a circular arena, first in first out)."""

    def __init__(self, numel: int):
        self.numel = numel
        self.buffer: torch.Tensor | None = None  # made at the first chunk
        self.head = 0  # where the next chunk goes, if it fits there
        # key -> (start, numel), oldest first
        self.chunks: OrderedDict[tuple[int, int], tuple[int, int]] = OrderedDict()

    def view(self, key: tuple[int, int]) -> torch.Tensor:
        start, numel = self.chunks[key]
        return self.buffer[start:start + numel]

    def _free_start(self, need: int) -> int | None:
        """Where `need` elements fit now, or None."""
        if not self.chunks:
            return 0
        tail = next(iter(self.chunks.values()))[0]  # the oldest chunk's start
        if tail >= self.head:  # free: [head, tail) (tail == head: full)
            return self.head if tail - self.head >= need else None
        if self.numel - self.head >= need:  # free: [head, end) and [0, tail)
            return self.head
        return 0 if tail >= need else None

    def place(self, key: tuple[int, int], numel: int, evict) -> torch.Tensor:
        """Room for chunk `key` of `numel` elements (uninitialised), `evict(key)` called for each
        older chunk that has to leave first."""
        need = _padded(numel)
        if need > self.numel:
            raise ValueError(f"a gradient chunk of {numel} elements does not fit the ring of {self.numel}")
        if self.buffer is None:
            from megazero.ops.aio import aligned_empty

            self.buffer = aligned_empty((self.numel,), torch.float32)
        start = self._free_start(need)
        while start is None:
            evict(next(iter(self.chunks)))
            del self.chunks[next(iter(self.chunks))]
            start = self._free_start(need)
        self.head = start + need
        self.chunks[key] = (start, numel)
        return self.buffer[start:start + numel]

    def clear(self) -> None:
        self.chunks.clear()
        self.head = 0


class GradSwapper:
    """One rank's reduced gradient chunks in a ring of host memory and, for those that leave it, in
    the swap files of the optimizer's sub-groups (one file per sub-group, chunk after chunk, each
    at a block-aligned offset); see the module docstring."""

    def __init__(self, files, groups: list, parts: list, buffer_count: int):
        self.files = files
        self.parts = parts
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
        partition = sum(sg.grad_padded for sg in groups)
        # buffer_count chunks' worth (the memory of as many write buffers), never more than the partition
        self.ring = _ChunkRing(min(max(1, buffer_count) * _padded(self.chunk_numel), partition))
        # unwritten elements kept in the ring: the oldest chunks are written ahead beyond this, so that
        # an eviction finds its write done; at most half the ring, and no more than a pass over the
        # partition evicts (none when it fits: nothing written)
        self._unwritten_limit = max(self.ring.numel // 2, 2 * self.ring.numel - partition)
        self._fragments = {id(part): _fragments_by_view(part) for part in parts}
        self._written: set[tuple[int, int]] = set()  # chunks holding this window's gradient (ring or file)
        self._stored: set[tuple[int, int]] = set()  # chunks whose file holds it (written, or being written)
        self._writes: dict[tuple[int, int], int] = {}  # writes in flight of chunks in the ring
        self._norms: dict[tuple[int, int], float] = {}
        self._nonfinite: dict[tuple[int, int], list[torch.nn.Parameter]] = {}
        self.factors: list[float] = []  # scale_gradients() factors, applied as each sub-group is read
        self._scratch: torch.Tensor | None = None  # accumulation onto evicted chunks (_add_evicted)
        self.reads_for_accumulation = 0
        self.chunks_written = self.chunks_read = 0  # to and from the files (reports, tests)

    # ---- writing, as each reduce-scatter completes -----------------------------------------------
    def _write(self, key: tuple[int, int]) -> None:
        """Start writing ring chunk `key` to its file."""
        sg, offset = self._where[key]
        self._writes[key] = self.files.submit_write_part(sg.grad_name, self.ring.view(key), offset,
                                                         4 * sg.grad_padded)
        self._stored.add(key)
        self.chunks_written += 1

    def _settle(self, key: tuple[int, int]) -> None:
        """Wait for ring chunk `key`'s write, if one is in flight (before its memory changes or goes)."""
        if key in self._writes:
            self.files.wait(self._writes.pop(key))

    def _evict(self, key: tuple[int, int]) -> None:
        """Ring chunk `key` leaves memory: its value stays in its file."""
        if key not in self._stored:
            self._write(key)
        self._settle(key)

    def _read(self, key: tuple[int, int], into: torch.Tensor) -> None:
        """Read chunk `key` (this window's value, in its file) into `into`, waited for."""
        sg, offset = self._where[key]
        self.files.wait(self.files.submit_read_part(sg.grad_name, into, offset))
        self.chunks_read += 1

    def _write_ahead(self) -> None:
        """Start writing the oldest unwritten ring chunks while more than `_unwritten_limit` elements
        are unwritten (the oldest are evicted first: their writes then have a head start)."""
        unwritten = [(key, numel) for key, (_, numel) in self.ring.chunks.items() if key not in self._stored]
        excess = sum(_padded(numel) for _, numel in unwritten) - self._unwritten_limit
        for key, numel in unwritten:
            if excess <= 0:
                break
            self._write(key)
            excess -= _padded(numel)

    def add(self, part, j: int, reduced: torch.Tensor) -> None:
        """Add this rank's reduced chunk `reduced` of layout bucket j of `part` into its gradient
        (what grad_views[j].add_(reduced) does in memory) and take its norm."""
        key = (id(part), j)
        if key in self.ring.chunks:  # accumulation, in memory
            self._settle(key)
            self._stored.discard(key)  # (its file, if any, is stale now)
            chunk = self.ring.view(key)
        elif key in self._written:  # accumulation onto a chunk evicted this window: beside the ring
            self._add_evicted(key, part, j, reduced)
            return
        else:  # the window's first: onto zeros, as the zeroed in-memory partition
            chunk = self.ring.place(key, reduced.numel(), self._evict)
            chunk.zero_()
        chunk.add_(reduced)
        self._note(part, j, chunk)
        self._written.add(key)
        self._write_ahead()

    def _add_evicted(self, key: tuple[int, int], part, j: int, reduced: torch.Tensor) -> None:
        """Read, add and write back an evicted chunk in a scratch buffer, not in the ring: placing it
        would evict the chunk the next add wants (the chunks come in the same order every micro-step),
        and every later micro-step would read the whole partition back."""
        if self._scratch is None:
            from megazero.ops.aio import aligned_empty

            self._scratch = aligned_empty((self.chunk_numel,), torch.float32)
        chunk = self._scratch[:reduced.numel()]
        self._read(key, chunk)
        self.reads_for_accumulation += 1
        chunk.add_(reduced)
        self._note(part, j, chunk)
        sg, offset = self._where[key]
        self.files.wait(self.files.submit_write_part(sg.grad_name, chunk, offset, 4 * sg.grad_padded))
        self.chunks_written += 1

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
        """Wait for every write in flight (before the step uses the chunks)."""
        for key in list(self._writes):
            self._settle(key)

    def start_window(self) -> None:
        """The next gradients start a new accumulation window (every chunk reads as zero)."""
        self.flush()
        self.ring.clear()
        self._written.clear()
        self._stored.clear()
        self._norms.clear()
        self._nonfinite.clear()
        self.factors = []

    # ---- what the step needs ---------------------------------------------------------------------
    def _value(self, key: tuple[int, int], scratch: torch.Tensor) -> torch.Tensor:
        """Chunk `key`'s value: its ring view (no write in flight), or read into `scratch`, or zeros there."""
        if key in self.ring.chunks:
            self._settle(key)
            return self.ring.view(key)
        if key in self._written:
            self._read(key, scratch)
        else:
            scratch.zero_()
        return scratch

    def submit_reads(self, sg, read_buffer) -> tuple[list[torch.Tensor], list[int]]:
        """`sg`'s gradient chunks: views of the ring for those in it, else reads started into
        `read_buffer()` (called only then: sg.grad_padded elements at least); (each chunk's tensor,
        the requests). A chunk not written this window is zero."""
        views, requests, buffer = [], [], None
        for part, j, numel, offset in zip(sg.parts, sg.chunks, sg.numels, sg.grad_offsets):
            key = (id(part), j)
            if key in self.ring.chunks:
                self._settle(key)
                views.append(self.ring.view(key))
                continue
            buffer = read_buffer() if buffer is None else buffer
            view = buffer[offset:offset + numel]
            views.append(view)
            if key in self._written:
                requests.append(self.files.submit_read_part(sg.grad_name, view, 4 * offset))
                self.chunks_read += 1
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
            scratch = torch.empty(self.chunk_numel, dtype=torch.float32)
            for view, start, numel in counted_slices(part, counted):
                if (id(part), view) in self._written:  # (a chunk not written is zero: adds 0.0)
                    chunk = self._value((id(part), view), scratch[:part.grad_views[view].numel()])
                    total += sum([squared_norm(chunk[start:start + numel])])  # as SquaredNormSum.add
        return all_reduce_sum(torch.tensor(total, dtype=torch.float64), group=group)

    def nonfinite_params(self) -> list[torch.nn.Parameter]:
        """The parameters with an inf or nan in this rank's reduced gradient chunks (in-memory order)."""
        return [p for part in self.parts for j in range(len(part.grad_views))
                for p in self._nonfinite.get((id(part), j), [])]

    def sync_grads(self, params: list[torch.nn.Parameter], group) -> None:
        """Sum the chunks of `params` over `group` (tied weights on other pipeline stages): each is
        taken from the ring or read, all-reduced, noted and, if not in the ring, written back."""
        wanted = {id(p) for p in params}
        scratch = torch.empty(0)
        for part in self.parts:
            if not any(id(p) in wanted for p in part.layout.params):
                continue
            if len(part.layout.params) != 1:
                raise RuntimeError("a tied parameter shares its ZeRO layout with others: build the state "
                                   "with isolate=[tied parameters]")
            for j, view in enumerate(part.grad_views):
                if scratch.numel() < view.numel():
                    from megazero.ops.aio import aligned_empty

                    scratch = aligned_empty((self.chunk_numel,), torch.float32)
                key = (id(part), j)
                g = self._value(key, scratch[:view.numel()])
                dist.all_reduce(g, group=group)
                self._note(part, j, g)
                self._written.add(key)
                if key in self.ring.chunks:
                    self._stored.discard(key)  # (its file, if any, is stale now)
                else:
                    sg, offset = self._where[key]
                    self.files.wait(self.files.submit_write_part(sg.grad_name, g, offset, 4 * sg.grad_padded))
                    self._stored.add(key)
                    self.chunks_written += 1

    def buffers(self) -> list[torch.Tensor]:
        """The ring's memory and the scratch chunk (for memory reports)."""
        return [t for t in (self.ring.buffer, self._scratch) if t is not None]
