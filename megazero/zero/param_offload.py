"""Parameter offload at ZeRO stage 3 (ZeRO-Infinity, `zero_optimization.offload_param`).

With `device: nvme` each rank's partitions of the partitioned (non-persistent) parameters live in
swap files (megazero.zero.swap, through the asynchronous I/O op) instead of memory. The unit
machinery above is unchanged: `UnitFetcher` still only calls `_Shard.start_gather()` and
`_Shard.release()`, and the shard reads its partition back below them:

- start_gather(): the partition's read is submitted (when it is not cached), then it is
  all-gathered. At DP=1 the wait for the read is deferred to the handle's wait(), so a prefetched
  unit's read overlaps the current unit's compute; at DP>1 the read is waited for before the
  all-gather is started (collectives must start in the same order on every rank), and the gather
  overlaps compute as without offload. So that this wait finds the read done, the fetcher reads
  ahead (read_ahead()) the partition of the unit after the prefetched one, one unit before its
  gather starts, into a free pool buffer only (forget(): a read ahead whose unit never ran).
- A partition read back (or held for an overwrite) lands in a buffer of the pool (DeepSpeed's
  `buffer_count` buffers of `buffer_size` elements; `PartitionBuffers`), reused from one partition
  to the next, 4096-aligned so the op can use O_DIRECT: what fetches hold in memory is bounded by
  the pool, and steady-state steps allocate nothing. A buffer is made at its first use, of the
  largest partition's bytes (never more than buffer_size elements; a larger partition is an error
  naming buffer_size). When every buffer holds a partition still in use (e.g. the optimizer's
  first step loading a whole sub-group of partitions at once), the partition gets its own memory,
  counted in `PartitionBuffers.overflows`.
- Once gathered, the partition is dropped from memory, except that up to `max_in_cpu` elements of
  partitions stay cached (least recently used dropped first; a cached partition's buffer is taken
  back when a read needs one). The tensor keeps its shape, its storage becomes 0 bytes, and its
  bucket views (`shard_views`) are made anew whenever its memory changes.
- After the optimizer step the masters are cast into each partition one at a time, which is then
  written back (update_model, or the offloaded optimizer's step sub-group by sub-group), up to
  `buffer_count` - 1 writes left in flight while the next partitions are cast (their buffers are the
  pool's: a cast that finds none free waits for the oldest write), the last waited for at the end
  of the pass; nothing is read for that, since the cast overwrites it all. (One write in flight
  made the step wait on each write in turn, behind the optimizer's own sub-group I/O, with both
  offloads.)

Persistent parameters (under stage3_param_persistence_threshold) stay whole in memory, as in
DeepSpeed. An fp32 model's partitions are normally its master weights themselves; with parameter
offload every shard (persistent ones too, for uniformity) gets a separate fp32 master (in memory,
or swapped too by offload_optimizer), so that the partition can leave memory; the arithmetic is
the same (an fp32 -> fp32 cast is a copy).
`device: cpu` on a CPU-only machine is the in-memory path itself (nothing is copied twice).

On a GPU (untested here: no device) the partitions' home is host memory: `device: cpu` keeps them
there (no files, none ever dropped), `device: nvme` reads them into the pool's (pinned) buffers as
above. `staging` (megazero.zero.staging) copies each to the GPU ahead of its gather: from
read_ahead() when it is in host memory already, else when its gather starts (`_Shard`'s staged
gather). The copy is released in done(), and also before anything overwrites or frees its host
buffer. On the CPU the staging is the identity.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict

import torch

from megazero.zero.staging import PartitionStaging
from megazero.zero.swap import SwapFiles, run_swap_files


def _resident(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0


class PartitionBuffers:
    """offload_param's pool: at most `count` reusable aligned byte buffers, each of `nbytes` (the
    largest partition's bytes, set before the first take(); at most `size` elements)."""

    def __init__(self, count: int, size: int, pin: bool = False):
        self.count, self.size, self.pin = count, size, pin
        self.nbytes = 0
        self._free: list[torch.Tensor] = []
        self.made = 0  # buffers allocated so far (<= count)
        self.in_use = 0
        self.peak_in_use = 0
        self.overflows = 0  # partitions given their own memory: every buffer was in use

    def take(self) -> torch.Tensor | None:
        """A free buffer (uint8, 4096-aligned), or None when all `count` are in use."""
        small = [b for b in self._free if b.numel() < self.nbytes]  # made before a larger partition came
        if small:
            self._free = [b for b in self._free if b.numel() >= self.nbytes]
            self.made -= len(small)
        if not self._free and self.made < self.count:
            from megazero.ops.aio import aligned_empty

            self._free.append(aligned_empty((self.nbytes,), torch.uint8, pin_memory=self.pin))
            self.made += 1
        if not self._free:
            return None
        self.in_use += 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return self._free.pop()

    def available(self) -> bool:
        """Whether take() would return a buffer (one free and large enough, or one more to make)."""
        return self.made < self.count or any(b.numel() >= self.nbytes for b in self._free)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer from take()."""
        self.in_use -= 1
        self._free.append(buffer)

    def reset_peak(self) -> None:
        """Measure peak_in_use (and overflows) anew from now."""
        self.peak_in_use, self.overflows = self.in_use, 0


class ParamSwapper:
    """Where one rank's partitioned parameter shards live: swap files (`files`; device nvme) or host
    memory (`files` None: device cpu on a GPU, every partition kept there, nothing read or written),
    which of them are in host memory, and their copies to the compute device (`staging`, the
    identity on the CPU: megazero.zero.staging)."""

    def __init__(self, files: SwapFiles | None, max_in_cpu: int, buffer_count: int = 5,
                 buffer_size: int = 100_000_000, staging: PartitionStaging | None = None):
        self.files = files
        self.staging = staging if staging is not None else PartitionStaging()
        # host memory as the partitions' home: none ever leaves it
        self.max_in_cpu = max_in_cpu if files is not None else float("inf")
        self.pool = PartitionBuffers(buffer_count, buffer_size, self.staging.pin)
        self.writes_in_flight = max(1, buffer_count - 1)  # write-backs left in flight during an update pass
        self._pooled: dict[int, torch.Tensor] = {}  # id(shard) -> the pool buffer its partition is in
        self._in_use: set[int] = set()  # loaded or held, not done with yet: never evicted for a buffer
        self._writing: OrderedDict[int, tuple] = OrderedDict()  # id(shard) -> (shard, write request), oldest first
        self._pass: set[int] = set()  # shards written back since the last fetch
        self.shards: list = []
        self._cache: OrderedDict[int, object] = OrderedDict()  # id(shard) -> shard, in memory, LRU first
        self._reads: dict[int, int] = {}  # id(shard) -> read request in flight
        self.resident_numel = 0  # partition elements in memory now
        self.peak_resident_numel = 0
        self.setup_peak_numel = 0  # the peak while the shards were being added
        self.reads = 0

    def add(self, shard) -> None:
        """Move a new shard's partition to its swap file (as the state builds it: one unit's
        partitions in memory at a time)."""
        # weakly: the model (whose parameters reach the shards) may outlive the engine's state;
        # the swap files go with the state
        numel = shard.shard.numel()
        if self.files is not None and numel > self.pool.size:  # (device cpu: no pool)
            shapes = [tuple(shape) for shape in list(shard.layout.shapes.values())[:4]]
            raise ValueError(f"zero_optimization.offload_param.buffer_size={self.pool.size:,} elements is smaller "
                             f"than a parameter partition of {numel:,} elements (this rank's share of parameters "
                             f"of shapes {shapes}); set buffer_size >= {numel:,}")
        if shard.shard.device.type != "cpu":  # a GPU run: the partition's home is host memory
            shard.shard = self.staging.to_host(shard.shard)
            shard.shard_views = shard.layout.split_partition(shard.shard)
        self.pool.nbytes = max(self.pool.nbytes, numel * shard.shard.element_size())
        shard.swap, shard.swap_name = weakref.proxy(self), f"param{len(self.shards):05d}"
        self.shards.append(shard)
        if self.files is not None:
            self.files.wait(self.files.submit_write(shard.swap_name, shard.shard))
        self._cache[id(shard)] = shard
        self.resident_numel += shard.shard.numel()
        self.setup_peak_numel = max(self.setup_peak_numel, self.resident_numel)
        if self.files is not None:
            self._evict(limit=0)  # nothing cached at the start: the partitions live in the files

    def reset_peak(self) -> None:
        """Measure peak_resident_numel (and the pool's peak) from what is in memory now."""
        self.peak_resident_numel = self.resident_numel
        self.pool.reset_peak()

    # ---- residency -------------------------------------------------------------------------------
    def _allocate(self, shard) -> None:
        self._in_use.add(id(shard))
        buffer = self.pool.take()
        while buffer is None and self._writing:  # writes in flight hold buffers: the oldest lands first
            self._finish_writes(keep=len(self._writing) - 1)
            buffer = self.pool.take()
        if buffer is None:  # take back the buffer of the least recently used cached partition
            victim = next((s for k, s in self._cache.items() if k in self._pooled and k not in self._in_use
                           and k not in self._reads and k not in self._writing), None)
            if victim is not None:
                self._drop(victim)
                buffer = self.pool.take()
        t = shard.shard
        if buffer is None:  # every buffer holds a partition in use: own memory, as without a pool
            self.pool.overflows += 1
            t.untyped_storage().resize_(t.numel() * t.element_size())
        else:
            self._pooled[id(shard)] = buffer
            t.set_(buffer.untyped_storage(), buffer.storage_offset() // t.element_size(), t.shape)
        shard.shard_views = shard.layout.split_partition(t)
        self._cache[id(shard)] = shard
        self.resident_numel += shard.shard.numel()
        self.peak_resident_numel = max(self.peak_resident_numel, self.resident_numel)

    def submit_load(self, shard) -> None:
        """Start reading `shard`'s partition into memory (nothing when it is cached or on its way)."""
        if id(shard) in self._cache:
            self._cache.move_to_end(id(shard))
            self._in_use.add(id(shard))  # its buffer is not taken back before it is gathered
            return
        self._allocate(shard)
        self._reads[id(shard)] = self.files.submit_read(shard.swap_name, shard.shard)
        self.reads += 1

    def read_ahead(self, shard) -> bool:
        """Start reading `shard`'s partition ahead of its gather, only into a free pool buffer (no
        cached partition's buffer is taken back and no memory of its own is made for it: a read
        ahead must not grow memory). A partition in host memory already is copied to the compute
        device instead, where that is not the host (staging). False when nothing was started."""
        key = id(shard)
        if key in self._cache:
            if self.staging.identity or key in self._reads or key in self._writing:
                return False
            self._in_use.add(key)  # its host buffer is not taken back while the copy reads it
            self.staging.start(key, shard.shard)
            return True
        if not self.pool.available():
            return False
        self.submit_load(shard)
        return True

    def forget(self, shard) -> None:
        """A read ahead that will not be gathered: land it, then let it leave memory (max_in_cpu)."""
        request = self._reads.pop(id(shard), None)
        if request is not None:
            self.files.wait(request)
        self.staging.release(id(shard))
        self._in_use.discard(id(shard))
        self._evict(self.max_in_cpu)

    def load(self, shard) -> None:
        """`shard`'s partition is in memory when this returns (in use until done() or write_back())."""
        self.submit_load(shard)
        self._in_use.add(id(shard))
        request = self._reads.pop(id(shard), None)
        if request is not None:
            self.files.wait(request)

    @contextlib.contextmanager
    def loaded(self, shard):
        """`shard`'s partition in memory inside (load() on entry, done() on exit)."""
        self.load(shard)
        try:
            yield
        finally:
            self.done(shard)

    def hold_for_overwrite(self, shard) -> None:
        """`shard`'s partition has memory (contents unspecified unless cached): it is about to be
        overwritten whole."""
        self.staging.release(id(shard))  # a copy to the compute device must have read it first
        if id(shard) in self._writing:  # so must a write of the old content
            self._finish_writes(keep=len(self._writing), only=id(shard))
        if id(shard) in self._cache:
            self.load(shard)  # a read in flight must land before the overwrite
            self._cache.move_to_end(id(shard))
            self._in_use.add(id(shard))
        else:
            self._allocate(shard)

    def write_back(self, shard) -> None:
        """Write `shard`'s (changed) partition to its file, then drop what max_in_cpu does not keep.
        The write stays in flight while the caller casts the next partitions (up to buffer_count - 1
        writes, each in its pool buffer), is waited for at once when every swapped partition has
        been written since the last fetch (the end of an update pass), when a buffer is needed, or
        before anything else touches it."""
        key = id(shard)
        if self.files is None:  # host memory is its home: the cast has put it there
            self._in_use.discard(key)
            return
        if key in self._writing:
            self._finish_writes(only=key)
        self._writing[key] = (shard, self.files.submit_write(shard.swap_name, shard.shard))
        self._in_use.discard(key)
        self._pass.add(key)
        last = len(self._pass) >= len(self.shards)
        if last:
            self._pass.clear()
        self._finish_writes(keep=0 if last else self.writes_in_flight)

    def _finish_writes(self, keep: int = 0, only: int | None = None) -> None:
        """Wait for the oldest writes until `keep` are in flight (or for `only`'s), then evict."""
        while len(self._writing) > keep or only in self._writing:
            key = only if only in self._writing else next(iter(self._writing))
            _, request = self._writing.pop(key)
            self.files.wait(request)
        self._evict(self.max_in_cpu)

    def done(self, shard) -> None:
        """`shard`'s partition is not needed now: keep it cached within max_in_cpu, else drop it."""
        self.staging.release(id(shard))
        self._in_use.discard(id(shard))
        self._pass.clear()  # a fetch: an update pass counts its writes anew
        self._finish_writes()

    def _evict(self, limit: int) -> None:
        for key in list(self._cache):  # least recently used first
            if self.resident_numel <= limit:
                break
            # in flight, or held (e.g. a partition being cast whose last masters are in the next
            # sub-group, while the writes of others land): it stays
            if key in self._reads or key in self._writing or key in self._in_use:
                continue
            self._drop(self._cache[key])

    def _drop(self, shard) -> None:
        """Free `shard`'s partition memory (its buffer back to the pool); the tensor keeps its shape."""
        key = id(shard)
        self.staging.release(key)  # nor memory a copy to the compute device still reads
        if key in self._writing:  # never free memory a write is still reading
            self.files.wait(self._writing.pop(key)[1])
        self._cache.pop(key)
        self._in_use.discard(key)
        t = shard.shard
        buffer = self._pooled.pop(key, None)
        if buffer is not None:
            t.set_(torch.empty(t.shape, dtype=t.dtype, device=t.device))  # not touched: no pages
            self.pool.give(buffer)
        shard.shard_views = shard.layout.split_partition(t)  # no view keeps pointing into the buffer
        t.untyped_storage().resize_(0)
        self.resident_numel -= t.numel()

    def resident_tensors(self) -> list[torch.Tensor]:
        """The partitions in memory now."""
        return [s.shard for s in self._cache.values()]

    def on_device(self, shard) -> torch.Tensor:
        """`shard`'s partition (loaded: see load()) on the compute device: the host partition itself
        on the CPU; on a GPU its staged copy, the copy started now unless read_ahead() started it."""
        return self.staging.take(id(shard), shard.shard)

    def disk_bytes(self) -> int:
        """Bytes of this rank's parameter swap files."""
        return self.files.disk_bytes() if self.files is not None else 0

    def close(self) -> None:
        """Remove the swap files (also done at exit and at garbage collection)."""
        if self.files is not None:
            self.files.close()


def is_resident(shard) -> bool:
    """Whether a `_Shard`'s partition is in memory."""
    return _resident(shard.shard)


def compute_staging(model: torch.nn.Module, pin: bool) -> PartitionStaging:
    """The staging of partitions to the device `model`'s parameters compute on: the identity on the
    CPU (pin has no effect there), host -> GPU copies on CUDA; other devices are an error."""
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(f"zero_optimization.offload_param: the parameters are on several devices "
                         f"{sorted(map(str, devices))}; expected one")
    device = next(iter(devices), torch.device("cpu"))
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"zero_optimization.offload_param with parameters on {device.type!r} is not implemented "
                         f"(cpu and cuda are)")
    return PartitionStaging(device if device.type == "cuda" else None, pin)


def make_param_swapper(config, model: torch.nn.Module, group=None) -> ParamSwapper | None:
    """The ParamSwapper for `zero_optimization.offload_param` of an EngineConfig at stage 3: one for
    device nvme; for device cpu on a GPU (host memory); None for device none, or cpu with a model
    on the CPU (the in-memory path itself)."""
    offload = config.zero_optimization.offload_param
    if offload.device == "none":
        return None
    staging = compute_staging(model, offload.pin_memory)
    if offload.device == "cpu":
        return None if staging.identity else ParamSwapper(None, offload.max_in_cpu, offload.buffer_count,
                                                          offload.buffer_size, staging)
    files = run_swap_files(offload.nvme_path, group, config.aio.model_dump())
    return ParamSwapper(files, offload.max_in_cpu, offload.buffer_count, offload.buffer_size, staging)
