"""Optimizer offload (ZeRO-Offload / ZeRO-Infinity) for ZeRO stages 1-3.

`OffloadedState` wraps a partitioned (stages 1-2) or sharded (stage 3) state and keeps its fp32
master weights (where they are a copy of a 16-bit model; an fp32 model's masters are its own
partitions and stay) and the optimizer's per-element states (Adam's exp_avg / exp_avg_sq, ...)
off the model's memory:
- device nvme: in swap files (megazero.zero.swap), one per sub-group. The optimizer steps sub-group
  by sub-group (runs of whole master chunks of about `sub_group_size` elements): the next
  sub-group is read while this one steps and the previous one is written back, through a ring of
  `buffer_count` aligned host buffers and the asynchronous I/O op (megazero.ops.aio). The step
  does not wait for its last write-backs: they finish while the next forward and backward run,
  and the first sub-groups of the next step are read back into their ring buffers as soon as the
  write of what a buffer held has landed (a read submitted `after` that write: never before it,
  and not at all if it failed), so the next step finds them in memory. Anything else that uses
  the files (a checkpoint save or load, `resident()`, close) first waits for that I/O
  (finish_io()); a write that failed raises there, or at the next step before anything is
  stepped, with the path, and its sub-group stays in its buffer and is written again at the next
  try: nothing is lost. Memory stays `buffer_count` sub-group buffers.
- device cpu on a GPU: in (pinned) host memory; gradients are copied to the host sub-group by
  sub-group and the 16-bit parameters copied back. On a CPU-only machine `device: cpu` is the
  in-memory path itself (the factory, megazero.zero.factory, wraps nothing: nothing is copied twice).

With device nvme at stages 2 and 3 (on the CPU) the reduced fp32 gradient partitions go to swap
files too, as each bucket's reduce-scatter completes (megazero.zero.grad_swap, as DeepSpeed swaps
them): their norm and inf/nan check are taken as they are written, accumulation over micro-steps
reads, adds and writes each chunk, and the step reads each sub-group's gradients with its masters
and moments. Stage 1's reduced chunks are views of its full gradient buffer and stay there.

The step is the same arithmetic as the in-memory one, bit for bit: the same optimizer runs on the
same master tensors with the same hyper-parameters, only fewer of them at a time (optimizers skip
masters without a gradient; every per-tensor quantity, e.g. Lamb's trust ratio, sees whole
tensors). `OffloadedOptimizer` is what the engine steps: it holds the real optimizer and hands
step() to the state. Checkpoints hold exactly what the wrapped state writes (masters and
optimizer states are made resident for the save or load), so they load with offload on or off.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from megazero.distributed import all_reduce_sum
from megazero.optim.protocol import step_with_grad_scale, takes_grad_scale, writes_copies
from megazero.zero.grad_swap import GradSwapper, drop_grad_partition
from megazero.zero.protocol import PartitionedMasters
from megazero.zero.staging import pinned
from megazero.zero.swap import SwapFiles, run_swap_files

ALIGN_ELEMENTS = 1024  # 4 KiB of fp32: each kind's region of a sub-group buffer stays block-aligned
_EMPTY = torch.empty(0)  # what a swapped-out master or state holds


def _padded(numel: int) -> int:
    return -(-numel // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


class _SubGroup:
    """A run of whole master chunks of one optimizer param group, stepped together."""

    def __init__(self, index: int, entries: list[tuple[object, int]]):
        self.index = index
        self.name = f"optimizer{index:05d}"
        self.parts = [part for part, _ in entries]
        self.chunks = [j for _, j in entries]  # each master's index in its part
        self.masters = [part.masters[j] for part, j in entries]
        self.grads = [part.grad_views[j] for part, j in entries]
        # kept: a swapped-out (or deferred) master is empty; its gradient view has the chunk's size
        self.numels = [part.grad_views[j].numel() for part, j in entries]
        self.offsets, total = [], 0
        for numel in self.numels:
            self.offsets.append(total)
            total += numel
        self.numel = total
        self.padded = _padded(total)
        self.kinds_saved = 0  # how many kinds (master, then state keys) its swap file holds

    def views(self, buffer: torch.Tensor, kind: int) -> list[torch.Tensor]:
        """Each master's slice of `buffer`'s region for kind number `kind`."""
        base = kind * self.padded
        return [buffer[base + o:base + o + n] for o, n in zip(self.offsets, self.numels)]


def sub_groups(parts: list, sub_group_size: int) -> list[_SubGroup]:
    """Cut the parts' masters (optimizer order) into sub-groups of at most `sub_group_size`
    elements, never splitting a master chunk nor mixing param groups."""
    out, current, filled, group = [], [], 0, None
    for part in parts:
        for j, grad in enumerate(part.grad_views):  # a master chunk's size (a deferred master is empty)
            if current and (part.group_index != group or filled + grad.numel() > sub_group_size):
                out.append(_SubGroup(len(out), current))
                current, filled = [], 0
            current.append((part, j))
            filled += grad.numel()
            group = part.group_index
    if current:
        out.append(_SubGroup(len(out), current))
    return out


def _aligned(numel: int, pin: bool) -> torch.Tensor:
    from megazero.ops.aio import aligned_empty

    return aligned_empty((numel,), torch.float32, pin_memory=pin and torch.cuda.is_available())


class OffloadedState:
    """A ZeRO stage 1-3 state whose masters and optimizer states live on NVMe (or host memory on a
    GPU); the protocol of megazero.zero.protocol, delegated to the wrapped state, with the masters
    made resident wherever the wrapped state reads them."""

    def __init__(self, inner: PartitionedMasters, device: str, nvme_path: str | None, sub_group_size: int,
                 buffer_count: int, pin_memory: bool, aio_config: dict, group=None):
        if device not in ("cpu", "nvme"):
            raise ValueError(f"offload device must be 'cpu' or 'nvme', got {device!r}")
        self.inner = inner
        self.stage = inner.stage
        self.device = device
        self.pin = pin_memory
        self.buffer_count = buffer_count
        self.separate = not all(part.aliased for part in inner.parts)
        on_gpu = any(m.device.type != "cpu" for part in inner.parts for m in part.masters)
        if on_gpu and not self.separate:
            raise ValueError("optimizer offload of an fp32 model on GPU is not implemented: use bf16 or fp16")
        self.groups = sub_groups(inner.parts, sub_group_size)
        self.kinds: list[str] = ["master"] if self.separate else []  # per-element tensors, in buffer order
        self.optimizer: torch.optim.Optimizer | None = None  # set by OffloadedOptimizer
        self.copies: dict[int, torch.Tensor] = {}
        self._copies_by_optimizer = False
        self._resident = 0
        self._slots: list[torch.Tensor] = []
        # I/O the step left in flight: sub-group index -> (its write, its slot); sub-group index ->
        # (its early read for the next step, ring size, slot size); sub-group index -> its slot
        # when its write failed (the slot then holds its only copy)
        self._deferred: dict[int, tuple[int, int]] = {}
        self._early: dict[int, tuple[int, int, int]] = {}
        self._unsaved: dict[int, int] = {}
        self.files: SwapFiles | None = None
        # stage 3 with parameter offload and no copy targets: the step casts each sub-group's masters
        # into the parameter partitions (update_model would need every master resident at once)
        self._casts_params = device == "nvme" and self.separate and inner.params_in_swap
        if on_gpu:
            self._masters_to_host()
        if device == "nvme":
            self.files = run_swap_files(nvme_path, group, aio_config)
            self._swap_out_all(write=True)
        self.grads: GradSwapper | None = None  # the gradient partitions in swap files (stages 2 and 3)
        self._grad_slots: list[torch.Tensor] = []
        if device == "nvme" and not on_gpu and inner.gradients_partitioned:
            self.grads = GradSwapper(self.files, self.groups, inner.parts, buffer_count)
            for part in inner.parts:
                drop_grad_partition(part)  # (stage 3 with swapped gradients never made them: the same again)
                # weakly: the model (whose parameters reach stage 3's shards) may outlive the state
                part.grad_sink = weakref.proxy(self.grads)

    # ---- placement -------------------------------------------------------------------------------
    def _masters_to_host(self) -> None:
        """GPU: the fp32 masters move to (pinned) host memory, where the CPU optimizer steps them."""
        for part in self.inner.parts:
            flat = torch.cat([m.detach().reshape(-1) for m in part.masters]).cpu()
            flat = pinned(flat, self.pin)
            for master, view in zip(part.masters, part.layout.split_partition(flat)):
                master.data = view
            part.master_flat = flat

    def _state_keys(self, sg: _SubGroup) -> list[str]:
        """The optimizer's per-element state keys of `sg`'s masters (tensors as large as the master)."""
        state = self.optimizer.state.get(sg.masters[0], {}) if self.optimizer is not None else {}
        return [k for k, v in state.items() if torch.is_tensor(v) and v.dim() >= 1
                and v.numel() == sg.numels[0]]

    def _bind(self, sg: _SubGroup, buffer: torch.Tensor, kinds: int) -> None:
        """Point the first `kinds` kinds of `sg` (master data, state tensors) into `buffer`."""
        for k, name in enumerate(self.kinds[:kinds]):
            for master, view in zip(sg.masters, sg.views(buffer, k)):
                if name == "master":
                    master.data = view
                else:
                    self.optimizer.state[master][name] = view

    def _pack(self, sg: _SubGroup, buffer: torch.Tensor | None) -> torch.Tensor:
        """A buffer holding every kind of `sg` now (what it has new, e.g. states the first step
        made, copied in); `buffer` when it is large enough."""
        for key in self._state_keys(sg):
            if key not in self.kinds:
                self.kinds.append(key)
        need = len(self.kinds) * sg.padded
        if buffer is None or buffer.numel() < need:
            buffer = _aligned(need, self.pin)
        for k, name in enumerate(self.kinds):
            for part, j, master, view in zip(sg.parts, sg.chunks, sg.masters, sg.views(buffer, k)):
                source = part.master_values(j) if name == "master" else self.optimizer.state[master][name]
                if source.data_ptr() != view.data_ptr():
                    view.copy_(source.reshape(-1))
        return buffer

    def _unbind(self, sg: _SubGroup) -> None:
        # a new dict per master: a state_dict() taken while resident shares the old ones
        states = [k for k in self.kinds if k != "master"]
        for master in sg.masters:
            if "master" in self.kinds:
                master.data = _EMPTY
            if states and master in self.optimizer.state:
                self.optimizer.state[master] = {**self.optimizer.state[master], **dict.fromkeys(states, _EMPTY)}

    def _release_flats(self) -> None:
        for part in self.inner.parts:
            if not part.aliased:
                part.master_flat = _EMPTY

    def _swap_out_all(self, write: bool, buffers: dict | None = None) -> None:
        """Every sub-group to its file (`write`: its content changed; `buffers`: sub-group index ->
        a buffer to reuse) and out of memory."""
        pending = []
        unbound: dict[int, int] = {}  # id(part) -> its masters swapped out so far
        for sg in self.groups:
            if write and (self.kinds or self._state_keys(sg)):
                with contextlib.ExitStack() as loaded:  # deferred masters: their values are in the partitions
                    for part in {id(p): p for p in sg.parts if p.master_deferred}.values():
                        loaded.enter_context(part.partition_loaded())
                    buffer = self._pack(sg, (buffers or {}).get(sg.index))
                sg.kinds_saved = len(self.kinds)
                pending.append((self.files.submit_write(sg.name, buffer[:sg.kinds_saved * sg.padded]), buffer))
                while len(pending) > self.buffer_count:  # a bounded number of buffers in flight
                    self.files.wait(pending.pop(0)[0])
            self._unbind(sg)
            for part in sg.parts:  # a part's flat master goes once all its masters are out
                unbound[id(part)] = unbound.get(id(part), 0) + 1
                if unbound[id(part)] == len(part.masters) and not part.aliased:
                    part.master_flat = _EMPTY
        self._release_flats()
        for request, _ in pending:
            self.files.wait(request)
        for part in self.inner.parts:
            part.master_deferred = False

    @contextlib.contextmanager
    def resident(self, dirty: bool = True):
        """Every master and optimizer state in memory inside (for checkpoints and model loads);
        written back on exit when `dirty`. Re-entrant; a no-op for device cpu."""
        if self.files is None or self._resident:
            self._resident += 1
            try:
                yield
            finally:
                self._resident -= 1
            return
        self.finish_io()
        self._resident += 1
        buffers = {}
        try:
            for part in self.inner.parts:
                if not part.aliased:
                    flat = torch.empty(part.layout.partition_numel, dtype=torch.float32)
                    for master, view in zip(part.masters, part.layout.split_partition(flat)):
                        master.data = view
                    part.master_flat = flat
            for sg in self.groups:
                if sg.kinds_saved:
                    buffers[sg.index] = buffer = _aligned(sg.kinds_saved * sg.padded, self.pin)
                    self.files.wait(self.files.submit_read(sg.name, buffer))
                    for k, name in enumerate(self.kinds[:sg.kinds_saved]):
                        for master, view in zip(sg.masters, sg.views(buffer, k)):
                            if name == "master":
                                master.data.copy_(view)
                            else:
                                self.optimizer.state[master][name] = view
            yield
        finally:
            self._resident -= 1
            self._swap_out_all(write=dirty, buffers=buffers)

    # ---- the step --------------------------------------------------------------------------------
    def set_copy_targets(self, copies: dict[int, torch.Tensor], by_optimizer: bool) -> None:
        """{id(master): 16-bit tensor}; `by_optimizer`: the optimizer writes them in its step."""
        self.copies = dict(copies)
        self._copies_by_optimizer = by_optimizer

    def _slot(self, index: int, numel: int) -> torch.Tensor:
        while len(self._slots) <= index:
            self._slots.append(torch.empty(0))
        if self._slots[index].numel() < numel:
            self._slots[index] = _aligned(numel, self.pin)
        return self._slots[index]

    def finish_io(self, keep_early_reads: bool = False) -> None:
        """Wait for the I/O the last step left in flight: its write-backs (a failed one is written
        again from its buffer first; an OSError naming the file if one fails, its sub-group kept in
        its buffer for the next try) and, unless `keep_early_reads`, the next step's early reads
        (dropped: the step reads again, e.g. after a load rewrote the files)."""
        if self.files is None:
            return
        failure = None
        for i, slot in list(self._unsaved.items()):  # their buffers hold their only copy
            sg = self.groups[i]
            try:
                self.files.rewrite_header(sg.name)
                self.files.wait(self.files.submit_write(sg.name, self._slots[slot][:sg.kinds_saved * sg.padded]))
                del self._unsaved[i]
            except OSError as e:
                failure = failure or e
        for i, (request, slot) in list(self._deferred.items()):
            del self._deferred[i]
            try:
                self.files.wait(request)
            except OSError as e:
                self._unsaved[i] = slot
                failure = failure or e
        if failure is not None or not keep_early_reads:
            for request, _, _ in self._early.values():
                with contextlib.suppress(OSError):  # (not run when the write before it failed)
                    self.files.wait(request)
            self._early.clear()
        if failure is not None:
            raise failure

    def _read_early(self, writes: dict[int, int], k: int, size: int) -> None:
        """Read the next step's first sub-groups into their ring buffers, each after the write of
        what its buffer holds now (the last sub-group stepped in it); the writes stay in flight."""
        n = len(self.groups)
        self._deferred = {i: (request, i % k) for i, request in writes.items()}
        holder = {i % k: i for i in writes}  # slot -> the sub-group whose write-back it is the source of
        for i in range(min(k, n)):
            sg = self.groups[i]
            if sg.kinds_saved and i % k in holder:
                buffer = self._slots[i % k][:sg.kinds_saved * sg.padded]
                # (the file's header is checked when the step takes the read: see step)
                request = self.files.submit_read(sg.name, buffer, check=False, after=writes[holder[i % k]])
                self._early[i] = (request, k, size)

    def step(self, optimizer: torch.optim.Optimizer, grad_scale) -> None:
        """optimizer.step() over every sub-group: read the next one while this one steps and the
        previous one is written back (nvme), or in place (host memory). The last write-backs are
        left in flight, with the next step's first reads after them (see the module docstring)."""
        self.finish_io(keep_early_reads=True)  # a failed write-back raises here, before anything steps
        n, k = len(self.groups), max(1, min(self.buffer_count, len(self.groups)))
        size = len(self.kinds) * max((sg.padded for sg in self.groups), default=0)
        early, self._early = self._early, {}
        for i, (_, ring, slot_size) in list(early.items()):
            if (ring, slot_size) != (k, size):  # (read into another ring: read again)
                self.files.wait(early.pop(i)[0])
        reads: dict[int, int | None] = {}
        grad_reads: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
        writes: dict[int, int] = {}
        cast: dict[int, int] = {}  # id(part) -> its masters cast into its parameter partition so far

        def start_read(i: int) -> None:
            if i in reads or i >= n or self.files is None:
                return
            if i - k in writes:  # its slot was the buffer of sub-group i - k
                self.files.wait(writes.pop(i - k))
            sg = self.groups[i]
            buffer = self._slot(i % k, size)
            if i in early:  # read at the end of the last step: still this run's file?
                reads[i] = early.pop(i)[0]
                self.files.check(sg.name, 4 * sg.kinds_saved * sg.padded)
            else:
                reads[i] = (self.files.submit_read(sg.name, buffer[:sg.kinds_saved * sg.padded])
                            if sg.kinds_saved else None)
            if self.grads is not None:  # its gradients beside its masters and moments
                grad_reads[i] = self.grads.submit_reads(sg, lambda: self._grad_slot(i % k, sg.grad_padded))

        grown = False  # the first step made new states: a sub-group's buffer grew
        for i, sg in enumerate(self.groups):
            start_read(i)
            if k > 1:
                start_read(i + 1)  # overlaps this sub-group's step
            if self.files is not None:
                request = reads.pop(i)
                if request is not None:
                    self.files.wait(request)
                self._bind(sg, self._slots[i % k], sg.kinds_saved)
            grads = None
            if self.grads is not None:
                grads, requests = grad_reads.pop(i)
                for request in requests:
                    self.files.wait(request)
                for factor in self.grads.factors:  # scale_gradients(), as in memory: one pass per factor
                    for g in grads:
                        g.mul_(factor)
            self._step_sub_group(optimizer, sg, grad_scale, grads)
            if self._casts_params and not self.copies:
                self._cast_into_params(sg, cast)
            if self.files is not None:
                buffer = self._pack(sg, self._slots[i % k])
                sg.kinds_saved = len(self.kinds)
                if buffer is not self._slots[i % k]:  # the first step made new states: a larger buffer
                    grown = True
                    self.files.wait(self.files.submit_write(sg.name, buffer[:sg.kinds_saved * sg.padded]))
                else:
                    writes[i] = self.files.submit_write(sg.name, buffer[:sg.kinds_saved * sg.padded])
                self._unbind(sg)
        if self.files is None:
            return
        if grown:  # (the ring is re-made at the next step: nothing to read into early)
            for request in writes.values():
                self.files.wait(request)
        else:
            self._read_early(writes, k, size)

    def _cast_into_params(self, sg: _SubGroup, cast: dict[int, int]) -> None:
        """Cast `sg`'s stepped masters into their parameter partitions (stage 3 parameter offload): a
        swapped partition is held from its first master's cast and written back after its last, so
        that at most the partitions `sg` spans are in memory, never every master at once."""
        for part, j in zip(sg.parts, sg.chunks):
            done = cast.get(id(part), 0)
            part.write_master(j, first=done == 0, last=done + 1 == len(part.masters))
            cast[id(part)] = done + 1

    def _grad_slot(self, index: int, numel: int) -> torch.Tensor:
        while len(self._grad_slots) <= index:
            self._grad_slots.append(torch.empty(0))
        if self._grad_slots[index].numel() < numel:
            self._grad_slots[index] = _aligned(numel, self.pin)
        return self._grad_slots[index]

    def _step_sub_group(self, optimizer: torch.optim.Optimizer, sg: _SubGroup, grad_scale,
                        grads: list[torch.Tensor] | None = None) -> None:
        grads = sg.grads if grads is None else grads  # (read from the swap files)
        host_grads = [g if g.device.type == "cpu" else g.to("cpu", non_blocking=True) for g in grads]
        if any(g.device.type != "cpu" for g in grads):
            torch.cuda.synchronize()
        for master, grad in zip(sg.masters, host_grads):
            master.grad = grad
        try:
            step_with_grad_scale(optimizer, grad_scale)
        finally:
            for master in sg.masters:
                master.grad = None
        if self.copies and not self._copies_by_optimizer:  # as the state's update_model casts
            with torch.no_grad():
                for master in sg.masters:
                    self.copies[id(master)].copy_(master.detach().view_as(self.copies[id(master)]))

    # ---- the protocol, delegated -----------------------------------------------------------------
    @property
    def checkpoint_format(self) -> str:
        """The wrapped state's: checkpoints do not depend on where the states lived."""
        return self.inner.checkpoint_format

    @property
    def state_partitioned(self) -> bool:
        """As the wrapped state."""
        return self.inner.state_partitioned

    @property
    def params_partitioned(self) -> bool:
        """As the wrapped state."""
        return self.inner.params_partitioned

    @property
    def gradients_partitioned(self) -> bool:
        """As the wrapped state."""
        return self.inner.gradients_partitioned

    @property
    def bucket_count(self) -> int:
        """As the wrapped state."""
        return self.inner.bucket_count

    def optimizer_groups(self, groups: list[dict]) -> list[dict]:
        """The wrapped state's groups over its masters."""
        return self.inner.optimizer_groups(groups)

    def optimizer_to_step(self, optimizer: torch.optim.Optimizer) -> OffloadedOptimizer:
        """An OffloadedOptimizer: `optimizer` stepped sub-group by sub-group."""
        return OffloadedOptimizer(optimizer, [self])

    def begin_micro_step(self, boundary: bool, defer: bool = False) -> None:
        """As the wrapped state."""
        self.inner.begin_micro_step(boundary, defer)

    def after_backward(self, boundary: bool, defer: bool = False) -> None:
        """As the wrapped state."""
        self.inner.after_backward(boundary, defer)

    def reduce_gradients(self) -> None:
        """As the wrapped state; swapped gradients: their writes are waited for."""
        self.inner.reduce_gradients()
        if self.grads is not None:
            self.grads.flush()

    def grad_norm_squared(self, counted=None) -> torch.Tensor:
        """As the wrapped state (swapped gradients: from the norms taken as they were written)."""
        if self.grads is None:
            return self.inner.grad_norm_squared(counted)
        return self.grads.norm_squared(self.inner.group, counted)

    def grad_norm(self, counted=None, model_parallel_group=None) -> float:
        """As the wrapped state (swapped gradients: from the norms taken as they were written)."""
        total = self.grad_norm_squared(counted)
        if model_parallel_group is not None:
            total = all_reduce_sum(total, group=model_parallel_group)
        return total.item() ** 0.5

    def nonfinite_params(self) -> list[torch.nn.Parameter]:
        """As the wrapped state (swapped gradients: as noted when they were written)."""
        return self.inner.nonfinite_params() if self.grads is None else self.grads.nonfinite_params()

    def sync_grads(self, params: list[torch.nn.Parameter], group) -> None:
        """As the wrapped state (swapped gradients: read, summed, written back)."""
        if self.grads is None:
            self.inner.sync_grads(params, group)
        else:
            self.grads.sync_grads(params, group)

    def scale_gradients(self, factor: float) -> None:
        """As the wrapped state (swapped gradients: applied as each sub-group is read for the step)."""
        if self.grads is None:
            self.inner.scale_gradients(factor)
        else:
            self.grads.factors.append(factor)

    def attach_grads(self) -> None:
        """Nothing: each sub-group's gradients are attached while it steps."""

    def detach_grads(self) -> None:
        """Nothing: each sub-group's gradients are dropped once it has stepped."""

    def copy_targets(self) -> dict[int, torch.Tensor]:
        """As the wrapped state."""
        return self.inner.copy_targets()

    def update_model(self, copies_written: bool = False) -> None:
        """The wrapped state's update; the 16-bit copies were written sub-group by sub-group when
        copy targets were set (else the masters are made resident for the cast)."""
        if self._casts_params and not self.copies:
            self.inner.update_model(True)  # the step cast them (the persistent ones are re-gathered here)
        elif self.separate and not (copies_written or self.copies):
            with self.resident(dirty=False):
                self.inner.update_model(False)
        else:
            self.inner.update_model(True if self.separate else copies_written)

    def reset_masters(self) -> None:
        """Re-read the masters from the model (resident for the copy)."""
        with self.resident():
            self.inner.reset_masters()

    def start_window(self) -> None:
        """As the wrapped state (swapped gradients: every chunk reads as zero again)."""
        self.inner.start_window()
        if self.grads is not None:
            self.grads.start_window()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The wrapped state's tensors (its swapped-out masters are empty) and the sub-group buffers
        (gradients: the read buffers of the step and the write buffers of backward, when swapped)."""
        held = self.inner.memory_tensors()
        held["optimizer"] = list(held["optimizer"]) + list(self._slots)
        if self.grads is not None:
            held["gradients"] = list(held["gradients"]) + list(self._grad_slots) + self.grads.buffers()
        return held

    def disk_bytes(self) -> int:
        """Bytes of this rank's swap files (masters, optimizer states and, when swapped, gradients)."""
        return self.files.disk_bytes() if self.files is not None else 0

    def parameter_shapes(self) -> dict[int, torch.Size]:
        """As the wrapped state."""
        return self.inner.parameter_shapes()

    def gathered(self, params: list[torch.nn.Parameter]):
        """As the wrapped state."""
        return self.inner.gathered(params)

    def state_dict(self, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict:
        """The wrapped state's, with masters and optimizer states resident for it."""
        with self.resident(dirty=False):
            return self.inner.state_dict(optimizer, names)

    def same_layout(self, state: dict, names: dict[int, str]) -> bool:
        """As the wrapped state."""
        return self.inner.same_layout(state, names)

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        """The wrapped state's load, resident; written back to the swap files after."""
        with self.resident():
            self.inner.load_state_dict(state, optimizer)

    def export_parameter_states(self, saved: list[dict], module: dict):
        """The wrapped state's exporter (the files are its format)."""
        return self.inner.export_parameter_states(saved, module)

    def load_parameter_states(self, optimizer: torch.optim.Optimizer, weights: dict, states, param_groups) -> None:
        """The wrapped state's re-cut load, resident; written back after."""
        with self.resident():
            self.inner.load_parameter_states(optimizer, weights, states, param_groups)

    def close(self) -> None:
        """Wait for the I/O in flight, then remove the swap files (also done at exit and when the
        state is garbage collected)."""
        if self.files is not None:
            try:
                self.finish_io()
            finally:
                self.files.close()


class OffloadedOptimizer(torch.optim.Optimizer):
    """The optimizer the engine steps when the optimizer is offloaded: `inner` (the real one, over
    the masters) stepped sub-group by sub-group by each of `states` in turn (one, or an
    expert-parallel model's two: each holds its own masters). param_groups, state and state_dict()
    are `inner`'s (state_dict with everything resident)."""

    def __init__(self, inner: torch.optim.Optimizer, states: list[OffloadedState]):
        # no Optimizer.__init__: the groups and states are inner's own
        self.inner = inner
        self.offloads = list(states)
        for state in self.offloads:
            state.optimizer = inner
        self.defaults = inner.defaults
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._takes_scale = takes_grad_scale(inner)
        if self._takes_scale:  # a GradScaleTaker only then: the engine hands it the divisor
            self.grad_scale = None

    @classmethod
    def joined(cls, inner: torch.optim.Optimizer, optimizers: list[OffloadedOptimizer]) -> OffloadedOptimizer:
        """One OffloadedOptimizer stepping `inner` through the states of all of `optimizers`."""
        return cls(inner, [state for o in optimizers for state in o.offloads])

    @property
    def param_groups(self) -> list[dict]:
        """inner's groups (a load_state_dict replaces them there)."""
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self.inner.param_groups = groups

    @property
    def state(self):
        """inner's per-master state (swapped-out tensors are empty)."""
        return self.inner.state

    def set_copy_targets(self, copies: dict[int, torch.Tensor]) -> None:
        """Hand the 16-bit copies to inner when it writes them, else write them after each sub-group."""
        # the CPU op writes host tensors only: on a GPU the copies go back after each sub-group
        by_inner = writes_copies(self.inner) and all(c.device.type == "cpu" for c in copies.values())
        if by_inner:
            self.inner.set_copy_targets(copies)
        for state in self.offloads:  # (each looks up its own masters' copies)
            state.set_copy_targets(copies, by_optimizer=by_inner)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every master, sub-group by sub-group."""
        loss = closure() if closure is not None else None
        for state in self.offloads:
            state.step(self.inner, self.grad_scale if self._takes_scale else None)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """inner's."""
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """inner's, with every state resident."""
        with self._resident(dirty=False):
            return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """inner's, resident; written back to the swap files after."""
        with self._resident():
            self.inner.load_state_dict(state_dict)

    @contextlib.contextmanager
    def _resident(self, dirty: bool = True):
        with contextlib.ExitStack() as stack:
            for state in self.offloads:
                stack.enter_context(state.resident(dirty=dirty))
            yield
