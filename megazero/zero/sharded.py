"""ZeRO stage 3: parameters partitioned too; each unit is gathered just before use and released after.

Units (`megazero.zero.units`): as in DeepSpeed, every module that directly owns parameters, of any
model (`nn.Sequential`, `nn.ModuleList`, named attributes), small subtrees merged into one unit by
`stage3_module_granularity_threshold`. Per unit, optimizer param group and persistence, a `_Shard`
holds this rank's chunks of the flat parameters (model dtype), of the fp32 master weights and of
the gradients, the flat layout cut into buckets of `reduce_bucket_size`. A unit's parameters are
all-gathered before its forward, released after it, gathered again when the gradient of its
output arrives (just before its backward), and released once all its gradients have been copied
into the reduce buckets (`shard_buckets`: reduce-scattered `reduce_bucket_size` elements at a
time, during backward with `overlap_comm`, synchronously in the hook without); parameters read
outside their unit's forward (tied weights) are fetched on the read (`megazero.zero.unit_hooks`).
All fetching and releasing goes through one `UnitFetcher` (`megazero.zero.fetch`). Parameters
under `stage3_param_persistence_threshold` elements stay gathered, as in DeepSpeed. Once the first
step has shown the order the units run in, the next unit's gather is started while the current one
computes (forward: the next unit; backward: the previous one), for units up to
`stage3_prefetch_bucket_size` elements. After the optimizer step only the shards change: the next
forward gathers anew (persistent shards are all-gathered right away, coalesced: `megazero.zero.persistent`).
With optimizer offload to nvme (`swap_grads`) the gradient partitions are never allocated: each
reduced chunk goes to a swap file (`megazero.zero.grad_swap`). With parameter offload
(`megazero.zero.param_offload`) the non-persistent partitions live in swap files: start_gather()
reads the partition back before gathering it, and it is dropped once gathered (within max_in_cpu).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megazero.zero.averaging import AVERAGE_THEN_SUM, GradientAveraging
from megazero.zero.buckets import InflightLimit
from megazero.zero.collectives import Handle, all_gather_chunks
from megazero.zero.fetch import UnitFetcher
from megazero.zero.grad_swap import drop_grad_partition
from megazero.zero.init import GatheredParameters, materialize_init_shard
from megazero.zero.layout import FlatLayout
from megazero.zero.master_partitions import MasterPartitions
from megazero.zero.partition_checkpoint import PartitionCheckpoint
from megazero.zero.persistent import gather_persistent
from megazero.zero.shard_buckets import ShardedGradients
from megazero.zero.unit_hooks import UnitHooks
from megazero.zero.units import plan_units


def _empty_like(p: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=p.dtype, device=p.device)


class _Shard:
    """One (unit, param group, persistent or not): this rank's chunks of the parameters, of the
    master weights and of the gradients, over a FlatLayout cut into buckets of `bucket_numel`."""

    def __init__(self, params: list[torch.nn.Parameter], group_index: int, group, persistent: bool,
                 bucket_numel: int, swap_grads: bool = False):
        self.group_index = group_index
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.layout = FlatLayout(params, bucket_numel, self.world_size)
        self.persistent = persistent
        self.dtype, self.device = params[0].dtype, params[0].device
        full = torch.zeros(self.layout.numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for p in params:
                full[self.layout.offsets[p]:self.layout.offsets[p] + p.numel()].copy_(p.reshape(-1))
        self.shard = torch.cat(self.layout.own_chunks(full, self.rank))  # this rank's partition
        self.shard_views = self.layout.split_partition(self.shard)  # one per bucket
        # fp32 models: the shard is the master weight itself; 16-bit: an fp32 copy
        self.aliased = self.dtype == torch.float32
        self.master_flat = self.shard if self.aliased else self.shard.float()
        self.masters = [torch.nn.Parameter(v) for v in self.layout.split_partition(self.master_flat)]
        self.grad_sink = None  # set with optimizer offload to nvme (megazero.zero.grad_swap)
        if swap_grads and self.device.type == "cpu":  # never allocated: the reduced chunks go to swap files
            drop_grad_partition(self)
        else:
            self.grad_partition = torch.zeros(self.layout.partition_numel, dtype=torch.float32, device=self.device)
            self.grad_views = self.layout.split_partition(self.grad_partition)
        self.full: torch.Tensor | None = None
        self.swap = None  # a ParamSwapper when the partition lives in a swap file (param offload)
        self.master_deferred = False  # see separate_master()
        self.point_params(full)
        if not persistent:
            self.release()

    def point_params(self, full: torch.Tensor) -> None:
        """Make the parameters views of `full` (a whole flat buffer of the layout)."""
        self.full = full
        for p in self.layout.params:
            offset = self.layout.offsets[p]
            p.data = full[offset:offset + self.layout.numels[p]].view(self.layout.shapes[p])

    def separate_master(self, deferred: bool = False) -> None:
        """Give an fp32 shard a master of its own (param offload: the partition leaves memory, the
        master the optimizer steps must not). `deferred`: the master is not made here (it would
        put every master in memory at once): optimizer offload writes it to its swap file from the
        partition's, which holds the same values (`master_deferred` until then)."""
        if self.aliased:
            self.aliased = False
            if deferred:
                self.master_flat = torch.empty(0, dtype=torch.float32, device=self.device)
                self.masters = [torch.nn.Parameter(torch.empty(0, dtype=torch.float32, device=self.device))
                                for _ in self.layout.buckets]
                self.master_deferred = True
                return
            self.master_flat = self.shard.clone()
            self.masters = [torch.nn.Parameter(v) for v in self.layout.split_partition(self.master_flat)]

    def master_values(self, index: int) -> torch.Tensor:
        """Master `index`, or when deferred the parameter chunk with its values (partition_loaded)."""
        return self.shard_views[index] if self.master_deferred else self.masters[index].data

    def partition_loaded(self) -> contextlib.AbstractContextManager:
        """The parameter partition in memory inside (read from its swap file under param offload)."""
        return self.swap.loaded(self) if self.swap is not None else contextlib.nullcontext()

    def write_master(self, index: int, first: bool, last: bool) -> None:
        """Cast master `index` into the parameter partition; a swapped partition is held for the
        overwrite from the `first` and written back after the `last` (nothing is read for it)."""
        if first and self.swap is not None:
            self.swap.hold_for_overwrite(self)
        with torch.no_grad():
            view = self.shard_views[index]
            view.copy_(self.masters[index].detach().view_as(view))
        if last and self.swap is not None:
            self.swap.write_back(self)

    def _copy_own(self, full: torch.Tensor, views: list[torch.Tensor] | None = None) -> None:
        for chunk, own in zip(self.layout.own_chunks(full, self.rank), views or self.shard_views):
            chunk.copy_(own)

    def _gathered(self, full: torch.Tensor) -> None:
        self.point_params(full)
        if self.swap is not None:
            self.swap.done(self)  # the partition may leave memory (within max_in_cpu)

    def start_gather(self) -> Handle:
        """All-gather the chunks into a new full buffer (one collective per bucket); the parameters
        point into it once waited. Param offload: the partition is read from its swap file first."""
        if self.swap is not None and not self.swap.staging.identity:
            return self._start_staged_gather()
        full = torch.empty(self.layout.numel, dtype=self.dtype, device=self.device)
        if self.swap is not None and self.world_size == 1:  # no collective: the read is waited lazily
            self.swap.submit_load(self)

            def finish() -> None:
                self.swap.load(self)
                self._copy_own(full)
                self._gathered(full)

            return Handle([], finish)
        if self.swap is not None:
            self.swap.load(self)
        self._copy_own(full)
        inner = [all_gather_chunks(full[b.start:b.start + b.numel], self.group, "parameters")
                 for b in self.layout.buckets]
        return Handle(inner, lambda: self._gathered(full))

    def _start_staged_gather(self) -> Handle:
        """Param offload where the partitions' home (host memory) is not the compute device (a GPU):
        once in host memory, the partition is copied to the device, into the gather buffer and
        all-gathered on the staging side stream, so that it overlaps the compute stream's work;
        wait() makes the compute stream wait for it (megazero.zero.staging)."""
        staging = self.swap.staging
        self.swap.load(self)  # an nvme read, submitted a unit ahead (read_ahead), lands here
        with staging.side():
            full = torch.empty(self.layout.numel, dtype=self.dtype, device=self.device)
            self._copy_own(full, self.layout.split_partition(self.swap.on_device(self)))
            inner = [all_gather_chunks(full[b.start:b.start + b.numel], self.group, "parameters")
                     for b in self.layout.buckets]
            ready = staging.ready()

        def finish() -> None:
            staging.wait_ready(ready, full)
            self._gathered(full)

        return Handle(inner, finish)

    def read_ahead(self) -> bool:
        """Start reading the partition from its swap file ahead of start_gather(), into a free
        buffer of the pool (False: in memory already, on its way, no buffer free, or not swapped)."""
        return self.swap is not None and self.swap.read_ahead(self)

    def cancel_read(self) -> None:
        """A read_ahead() whose gather will not come: the partition may leave memory again."""
        if self.swap is not None:
            self.swap.forget(self)

    def release(self) -> None:
        """Free the full parameters (the Parameter objects stay, holding empty tensors)."""
        for p in self.layout.params:
            p.data = _empty_like(p)
        self.full = None

    def take_modification(self, src_rank: int) -> None:
        """Adopt the gathered parameters as modified on data-parallel rank `src_rank`."""
        if self.world_size > 1:
            src = dist.get_global_rank(self.group, src_rank) if self.group is not None else src_rank
            dist.broadcast(self.full, src=src, group=self.group)
        with torch.no_grad():
            if self.swap is not None:
                self.swap.hold_for_overwrite(self)
            self.shard.copy_(torch.cat(self.layout.own_chunks(self.full, self.rank)))
            if not self.aliased:
                self.master_flat.copy_(self.shard)
            if self.swap is not None:
                self.swap.write_back(self)


class ShardedState(MasterPartitions, PartitionCheckpoint):
    """ZeRO stage 3 over the optimizer's param groups (a megazero.zero.protocol.DataParallelState;
    checkpoints in the flat_partitions format, the parameters in it: the model file holds none).
    `grad_divisor`: what the summed gradients are divided by (None: the group's size);
    `install_hooks` False: the caller installs the UnitHooks over these units (with others')."""

    stage = 3
    params_partitioned = True
    gradients_partitioned = True  # each shard's reduced gradients are a partition of its own

    def __init__(self, model: torch.nn.Module, groups: list[list[torch.nn.Parameter]], group,
                 persistence_threshold: int, prefetch_numel: int = 50_000_000,
                 bucket_numel: int = 500_000_000, overlap: bool = True, granularity_threshold: int = 0,
                 param_swap=None, defer_masters: bool = False, swap_grads: bool = False,
                 averaging: GradientAveraging = AVERAGE_THEN_SUM, grad_divisor: int | None = None,
                 install_hooks: bool = True):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.bucket_numel = bucket_numel
        # param offload (megazero.zero.param_offload): partitions go to swap files as each unit is built
        self.param_swap = param_swap
        self.fetcher = UnitFetcher(prefetch_numel)
        group_of = {id(p): i for i, g in enumerate(groups) for p in g}
        for plan in plan_units(model, granularity_threshold):
            shards = []
            for gi in range(len(groups)):
                mine = [p for p in plan.params if group_of.get(id(p)) == gi]
                for p in mine:  # built under zero.Init: whole again, one unit at a time
                    materialize_init_shard(p)
                # as in DeepSpeed, parameters under the threshold stay whole (biases, norms: tiny
                # tensors whose gathers would cost more in latency than they save in memory)
                whole = [p for p in mine if p.numel() < persistence_threshold]
                split = [p for p in mine if p.numel() >= persistence_threshold]
                for persistent, these in ((True, whole), (False, split)):
                    if these:
                        shards.append(_Shard(these, gi, group, persistent, bucket_numel, swap_grads))
            if not shards:
                continue  # parameters outside the optimizer's groups (frozen): left as they are
            if param_swap is not None:
                for shard in shards:  # all: offload_optimizer treats a state's masters all alike
                    # defer_masters (optimizer offload to nvme): the swapped ones are written from their files
                    shard.separate_master(deferred=defer_masters and not shard.persistent)
                    if not shard.persistent:
                        param_swap.add(shard)
            unit = self.fetcher.add(plan.module, shards)
            for shard in shards:
                for p in shard.layout.params:
                    p._megazero_unit, p._megazero_shard = unit, shard
        self.units = self.fetcher.units
        self.params_in_swap = any(s.swap is not None for u in self.units for s in u.shards)
        # optimizer state index i <-> self.parts[i]: ordered by param group, then unit
        self.parts = sorted((s for u in self.units for s in u.shards), key=lambda s: s.group_index)
        # backward produces the gradients of the units roughly in reverse module order (the last
        # layer first, the embeddings last)
        backward_order = [s for u in reversed(self.units) for s in u.shards]
        device = self.parts[0].device if self.parts else torch.device("cpu")
        self.grads = ShardedGradients(backward_order, bucket_numel, group, self.world_size, dist.get_rank(group),
                                      overlap, device, InflightLimit(), averaging, grad_divisor)
        # after the gradient hooks: a unit is released once its gradients are copied. (A model with
        # two states, experts and the rest, gets one UnitHooks over both: megazero.zero.factory.)
        if install_hooks:
            UnitHooks(model, self.units)
        if param_swap is not None:
            param_swap.reset_peak()

    @property
    def prefetches(self) -> int:
        """Gathers started ahead of use (forward: the next unit; backward: the previous)."""
        return self.fetcher.prefetches

    # ---- the engine's interface ------------------------------------------------------------------
    @property
    def bucket_count(self) -> int:
        """Reduce-scatters per micro-step (buckets of reduce_bucket_size elements)."""
        return self.grads.bucket_count

    def begin_micro_step(self, boundary: bool, defer: bool = False) -> None:
        """Stage 3 reduce-scatters every micro-step, boundary or not (ValueError for `defer`: its
        gradients leave the parameters as they arrive)."""
        if defer:
            raise ValueError("ZeRO stage 3 reduce-scatters each gradient as it arrives: it cannot defer a "
                             "micro-step's reduction (use stage 0, 1 or 2)")
        self.grads.start_micro_step()

    def after_backward(self, boundary: bool, defer: bool = False) -> None:
        """Finish this micro-step's reduce-scatters and free any unit still gathered."""
        if not boundary:
            self.reduce_gradients()

    def reduce_gradients(self) -> None:
        """Wait for every shard's reduce-scatter; release what backward left gathered."""
        self.grads.finish_reduction()
        self.fetcher.release_all()
        self.fetcher.finish_order()

    def copy_targets(self) -> dict[int, torch.Tensor]:
        """{id(master): its 16-bit parameter shard} the optimizer may write in its update pass."""
        # swapped partitions are cast one at a time in update_model, not by the optimizer
        return {id(m): v for s in self.parts if not s.aliased and s.swap is None
                for m, v in zip(s.masters, s.shard_views)}

    def update_model(self, copies_written: bool = False) -> None:
        """Cast the masters into the parameter shards (unless the optimizer already did); re-gather
        the persistent ones."""
        with torch.no_grad():
            for s in self.parts:
                if s.swap is not None and not copies_written:  # one at a time: cast, write back, drop
                    s.swap.hold_for_overwrite(s)
                    s.shard.copy_(s.master_flat)
                    s.swap.write_back(s)
                elif not s.aliased and not copies_written:
                    s.shard.copy_(s.master_flat)
        gather_persistent([s for s in self.parts if s.persistent], self.group, self.bucket_numel)

    def reset_masters(self) -> None:
        """Re-read the master shards from the parameter shards."""
        with torch.no_grad():
            for s in self.parts:
                if not s.aliased:
                    if s.swap is not None:
                        s.swap.load(s)
                    s.master_flat.copy_(s.shard)
                    if s.swap is not None:
                        s.swap.done(s)

    def gathered(self, params: list[torch.nn.Parameter]) -> GatheredParameters:
        """The units holding `params` are whole inside it (zero.GatheredParameters)."""
        return GatheredParameters(params)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by kind (shards, and whatever is gathered right now)."""
        params = [s.shard for s in self.parts if s.swap is None] + [s.full for s in self.parts if s.full is not None]
        if self.param_swap is not None:  # only the partitions in memory now
            params += self.param_swap.resident_tensors()
        return {"parameters": params, "gradients": [s.grad_partition for s in self.parts],
                "optimizer": [s.master_flat for s in self.parts if not s.aliased]}

    def start_window(self) -> None:
        """Discard gradients and start the next accumulation window."""
        for s in self.parts:
            s.grad_partition.zero_()

