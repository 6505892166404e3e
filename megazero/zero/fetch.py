"""Fetching and releasing ZeRO-3 units: the one place where partitioned parameters become whole.

`UnitFetcher` is the interface the hooks (`megazero.zero.unit_hooks`), `GatheredParameters` and
the engine go through; nothing else makes a unit whole or frees it:

    fetch(unit)            the unit's parameters are whole when it returns (waits for a prefetch)
    prefetch(unit) -> bool start making it whole without waiting (False: nothing to start)
    release(unit)          free its non-persistent whole parameters (completes a prefetch first)
    release_all()          release every unit (end of backward)
    record(unit)           the first step's order of unit forwards (the prefetch order)
    prefetch_next(unit, step)  prefetch the nearest unit after (+1) / before (-1) `unit` in that
                           order that has something to gather, if it is within the prefetch size,
                           and start reading the partitions of the one after it (read_ahead)
    live_bytes / peak_bytes / reset_peak()   whole non-persistent parameter bytes held (buffers
                           of gathers in flight included)

A unit's parameters are made whole by its shards (`_Shard.start_gather`, an all-gather of this
rank's chunks into a new buffer the parameters then point into) and freed by `_Shard.release`;
a placement of the partitions elsewhere (host memory, NVMe) replaces those two, under this class.
`_Shard.read_ahead` (a no-op for partitions in memory) starts bringing a partition into memory one
unit before its gather starts, so that at DP>1, where a gather must wait for its partition before
the collective starts, the read has had a whole unit's compute to land; `_Shard.cancel_read`
gives it up (a read-ahead unit that never ran).
"""

from __future__ import annotations

import torch

from megazero.zero.collectives import Handle


class Unit:
    """A module whose parameters (`shards`: per param group, persistent or not) are fetched and
    released together. `held`: fetched on an access outside its own forward (a tied weight, a
    parent's functional use), so kept whole until its gradients are in (or the forward ends,
    without grad)."""

    def __init__(self, module: torch.nn.Module, shards: list, fetcher: UnitFetcher):
        self.module = module
        self.shards = shards
        self.fetcher = fetcher
        self.gathered = all(s.persistent for s in shards)
        self.held = False
        self.grads_pending = 0
        self.num_params = sum(len(s.layout.params) for s in shards)
        self.numel = sum(s.layout.numel for s in shards if not s.persistent)
        self.nbytes = sum(s.layout.numel * s.shard.element_size() for s in shards if not s.persistent)
        self.pending: list[Handle] = []  # a prefetch in flight

    def gather(self) -> None:
        """Make every parameter of the unit whole (through the fetcher)."""
        self.fetcher.fetch(self)

    def release(self) -> None:
        """Free the unit's non-persistent whole parameters (through the fetcher)."""
        self.fetcher.release(self)


class UnitFetcher:
    """Fetches and releases units (see the module docstring); `prefetch_numel`: the largest unit
    (elements) gathered ahead of use, 0: none."""

    def __init__(self, prefetch_numel: int):
        self.units: list[Unit] = []
        self.prefetch_numel = prefetch_numel
        self.prefetches = 0  # gathers started ahead of use
        self.read_aheads = 0  # units whose partitions were read ahead of their gather's start
        self.read_ahead_depth = 1  # units read ahead beyond the prefetched one (0: none)
        self._ahead: dict[int, Unit] = {}  # read ahead, gather not started yet
        self.order: list[Unit] = []  # units in the order the first step's forwards ran them
        self.order_done = False
        self._position: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def add(self, module: torch.nn.Module, shards: list) -> Unit:
        """A new unit of `module` over `shards`."""
        unit = Unit(module, shards, self)
        self.units.append(unit)
        return unit

    # ---- moving parameters ---------------------------------------------------------------------
    def prefetch(self, unit: Unit) -> bool:
        """Start gathering `unit` without waiting; False if it is whole or already on its way."""
        self._ahead.pop(id(unit), None)
        if unit.gathered or unit.pending:
            return False
        unit.pending = [s.start_gather() for s in unit.shards if not s.persistent]
        self.live_bytes += unit.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return True

    def fetch(self, unit: Unit) -> None:
        """Make `unit` whole (no-op when it is)."""
        if unit.gathered:
            return
        self.prefetch(unit)
        for handle in unit.pending:
            handle.wait()
        unit.pending = []
        unit.gathered = True

    def release(self, unit: Unit) -> None:
        """Free `unit`'s non-persistent whole parameters (a prefetch in flight is completed first:
        its collective must finish on every rank)."""
        if unit.pending:
            self.fetch(unit)
        unit.held = False
        if not unit.gathered or unit.numel == 0:
            return
        for shard in unit.shards:
            if not shard.persistent:
                shard.release()
        unit.gathered = False
        self.live_bytes -= unit.nbytes

    def release_all(self) -> None:
        """Release every unit."""
        for unit in self.units:
            self.release(unit)
        for unit in self._ahead.values():  # read ahead for a forward that did not run it
            for shard in unit.shards:
                if not shard.persistent:
                    shard.cancel_read()
        self._ahead.clear()

    def reset_peak(self) -> None:
        """Start measuring peak_bytes anew from what is held now."""
        self.peak_bytes = self.live_bytes

    # ---- prefetch order --------------------------------------------------------------------------
    def record(self, unit: Unit) -> None:
        """Note a unit's forward while the order is still being learnt (first occurrence only)."""
        if not self.order_done and id(unit) not in self._position:
            self._position[id(unit)] = len(self.order)
            self.order.append(unit)

    def finish_order(self) -> None:
        """The order is known (after the first step): prefetching starts."""
        self.order_done = True

    def prefetch_next(self, unit: Unit, step: int) -> None:
        """Prefetch the nearest unit after (step +1: forward) or before (-1: backward) `unit` that
        has non-persistent parameters, if it is not larger than prefetch_numel; then read ahead the
        partitions of the nearest such unit beyond it (its gather starts at the next unit)."""
        index = self._position.get(id(unit))
        if not self.order_done or index is None:
            return
        candidate = self._next_in_order(index, step)
        if candidate is None or candidate.numel > self.prefetch_numel:
            return
        if self.prefetch(candidate):
            self.prefetches += 1
        ahead = candidate
        for _ in range(self.read_ahead_depth):
            ahead = self._next_in_order(self._position[id(ahead)], step)
            if ahead is None or ahead.numel > self.prefetch_numel:
                break
            self.read_ahead(ahead)

    def _next_in_order(self, index: int, step: int) -> Unit | None:
        index += step
        while 0 <= index < len(self.order) and self.order[index].numel == 0:
            index += step
        return self.order[index] if 0 <= index < len(self.order) else None

    def read_ahead(self, unit: Unit) -> None:
        """Start reading `unit`'s partitions into memory (where they are placed elsewhere and a
        buffer is free) before its gather starts."""
        if unit.gathered or unit.pending or id(unit) in self._ahead:
            return
        started = [s.read_ahead() for s in unit.shards if not s.persistent]
        if any(started):
            self._ahead[id(unit)] = unit
            self.read_aheads += 1
