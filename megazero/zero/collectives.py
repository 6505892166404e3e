"""Reduce-scatter, all-gather and all-to-all over equal chunks, built from what is fast on each backend.

On NCCL the native reduce_scatter_tensor / all_gather_into_tensor are used. On gloo they are
several times slower than point-to-point and broadcast (benchmarks/bench_collectives.py; numbers in
the README), so there a reduce-scatter
is built from isend/irecv plus local adds, and an all-gather from one broadcast per rank. Both
work in place on a buffer of N equal chunks and return a handle whose wait() completes them, so a
bucket's communication can overlap the rest of backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megazero import watchdog


class Traffic:
    """Elements (and bytes) this process has sent and received through these collectives
    (ring-equivalent volumes: reduce-scatter and all-gather move (N-1)/N of the buffer each way,
    all-reduce twice that), and per kind of collective the number of calls and the largest buffer
    (elements)."""

    def __init__(self):
        self.sent = 0
        self.received = 0
        self.sent_bytes = 0
        self.received_bytes = 0
        self.calls: dict[str, int] = {}
        self.largest: dict[str, int] = {}

    def add(self, sent: int, received: int, kind: str | None = None, numel: int = 0, itemsize: int = 4) -> None:
        """Count one call of `kind` on a buffer of `numel` elements of `itemsize` bytes that moved
        sent/received elements."""
        self.sent += sent
        self.received += received
        self.sent_bytes += sent * itemsize
        self.received_bytes += received * itemsize
        if kind is not None:
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.largest[kind] = max(self.largest.get(kind, 0), numel)

    def reset(self) -> None:
        """Zero every counter."""
        self.sent = self.received = self.sent_bytes = self.received_bytes = 0
        self.calls.clear()
        self.largest.clear()


traffic = Traffic()


def _label(kind: str, what: str | None) -> str:
    return f"{kind} of {what}" if what else kind


def all_reduce(tensor: torch.Tensor, group, what: str | None = None) -> Handle:
    """Asynchronous sum all-reduce (native on every backend: gloo's is fast); `what` it carries
    names it for the watchdog ('gradient bucket 3')."""
    world = dist.get_world_size(group)
    if world == 1:
        return Handle([])
    moved = 2 * (world - 1) * tensor.numel() // world
    traffic.add(moved, moved, "all_reduce", tensor.numel(), tensor.element_size())
    return Handle([dist.all_reduce(tensor, group=group, async_op=True)], op=_label("all-reduce", what))


class Handle:
    """Pending communication: wait() blocks until it is done and then runs the finishing step.

    `op` names the operation for the watchdog (megazero.watchdog), which watches the wait of a
    handle that has one (the collectives here name theirs; callers may add what it carries).
    """

    def __init__(self, works: list, finish: Callable[[], None] | None = None, op: str | None = None):
        self._works = works
        self._finish = finish
        self.op = op

    @property
    def done(self) -> bool:
        """True once wait() has returned."""
        return not self._works and self._finish is None

    def wait(self) -> None:
        """Block until the communication is complete, then run the finishing step (once)."""
        dog = watchdog.active() if self.op is not None else None
        if dog is None:
            for work in self._works:
                work.wait()
        else:
            mark = dog.begin(self.op, self._works)
            try:
                for work in self._works:
                    work.wait()
            finally:
                dog.end(mark)
        self._works = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


def uses_native_collectives(group) -> bool:
    """True on NCCL (native reduce-scatter/all-gather are fastest there), False on gloo."""
    return dist.get_backend(group) == "nccl"


def _global(group, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def reduce_scatter_chunks(buffer: torch.Tensor, group, what: str | None = None) -> Handle:
    """Sum `buffer` (N equal chunks) over the group; afterwards chunk r of rank r holds the sum
    (`what`: as for all_reduce).

    Other chunks of the buffer are left with unspecified contents.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    chunks = buffer.view(world, -1)
    mine = chunks[rank]
    if world == 1:
        return Handle([])
    traffic.add((world - 1) * mine.numel(), (world - 1) * mine.numel(), "reduce_scatter", buffer.numel(),
                buffer.element_size())
    if uses_native_collectives(group):
        return Handle([dist.reduce_scatter_tensor(mine, buffer, group=group, async_op=True)],
                      op=_label("reduce-scatter", what))
    received = torch.empty((world - 1, chunks.shape[1]), dtype=buffer.dtype, device=buffer.device)
    works = []
    for i, peer in enumerate(p for p in range(world) if p != rank):
        works.append(dist.irecv(received[i], src=_global(group, peer), group=group))
    for peer in range(world):
        if peer != rank:
            works.append(dist.isend(chunks[peer], dst=_global(group, peer), group=group))

    def add_received() -> None:
        mine.add_(received.sum(dim=0) if world > 2 else received[0])

    return Handle(works, add_received, op=_label("reduce-scatter", what))


def all_gather_chunks(buffer: torch.Tensor, group, what: str | None = None, bucket_numel: int | None = None,
                      broadcasts: bool = False) -> Handle:
    """Every rank contributes chunk r (its own) of `buffer`; afterwards all chunks are filled everywhere
    (`what`: as for all_reduce). `bucket_numel`: the most elements one gather moves; a larger buffer
    is gathered in column slices of its chunks. `broadcasts`: each rank broadcasts its own chunk
    (counted as broadcasts) instead of an all-gather (which gloo also builds from broadcasts)."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world == 1:
        return Handle([])
    chunks = buffer.view(world, -1)
    width = chunks.shape[1]
    step = width if bucket_numel is None else max(1, min(width, bucket_numel // world))
    works = []
    for start in range(0, width, step):
        columns = chunks[:, start:start + step]
        if broadcasts:
            for r in range(world):
                traffic.add(columns.shape[1] if r == rank else 0, 0 if r == rank else columns.shape[1], "broadcast",
                            columns.shape[1], buffer.element_size())
            works += [dist.broadcast(columns[r], src=_global(group, r), group=group, async_op=True)
                      for r in range(world)]
            continue
        traffic.add((world - 1) * columns.shape[1], (world - 1) * columns.shape[1], "all_gather", columns.numel(),
                    buffer.element_size())
        if not uses_native_collectives(group):
            works += [dist.broadcast(columns[r], src=_global(group, r), group=group, async_op=True)
                      for r in range(world)]
        elif step == width:
            works.append(dist.all_gather_into_tensor(buffer, chunks[rank], group=group, async_op=True))
        else:  # a column slice is not contiguous across chunks: gather into a list of its rows
            works.append(dist.all_gather(list(columns.unbind(0)), columns[rank].contiguous(), group=group,
                                         async_op=True))
    return Handle(works, op=_label("broadcast" if broadcasts else "all-gather", what))


def exchange_chunks(send: torch.Tensor, received: torch.Tensor, group, what: str | None = None) -> Handle:
    """All-to-all over equal chunks: row r of `send` (shape (N, ...)) goes to rank r, and row r of
    `received` gets rank r's row for this rank (this rank's own row is copied). NCCL: the native
    all_to_all_single; gloo: one isend/irecv pair per peer (faster there than its all-to-all)."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    received[rank].copy_(send[rank])
    if world == 1:
        return Handle([])
    row = send[0].numel()
    traffic.add((world - 1) * row, (world - 1) * row, "all_to_all", send.numel(), send.element_size())
    if uses_native_collectives(group):
        return Handle([dist.all_to_all_single(received, send, group=group, async_op=True)],
                      op=_label("all-to-all", what))
    works = [dist.irecv(received[peer], src=_global(group, peer), group=group) for peer in range(world) if peer != rank]
    works += [dist.isend(send[peer], dst=_global(group, peer), group=group) for peer in range(world) if peer != rank]
    return Handle(works, op=_label("all-to-all", what))
