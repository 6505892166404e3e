"""ZeRO stage 3: parameters partitioned too; each unit is gathered just before use and released after.

Units: every element of an `nn.ModuleList` (the transformer layers) is a unit; the parameters
outside them (embeddings, final norm, a tied output layer used in the root's own forward) form the
root unit, gathered for the whole forward and backward. Per unit, optimizer param group and
persistence, a `_Shard` holds this rank's chunks of the flat parameters (model dtype), of the fp32
master weights and of the gradients, the flat layout cut into buckets of `reduce_bucket_size`.
A unit's parameters are all-gathered before its forward, released after it, gathered again when
the gradient of its output arrives (just before its backward), and released once all its
gradients have been copied into the reduce buckets (`shard_buckets`: reduce-scattered
`reduce_bucket_size` elements at a time, during backward with `overlap_comm`, synchronously in
the hook without). Parameters under `stage3_param_persistence_threshold` elements stay gathered,
as in DeepSpeed. Once the first step has shown the order the layers run in, the next layer's
gather is started while the current one computes (forward: the next layer; backward: the previous
one), for units up to `stage3_prefetch_bucket_size` elements. After the optimizer step only the
shards change: the next forward gathers anew (persistent shards are all-gathered right away).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.zero.buckets import InflightLimit
from megazero.zero.collectives import Handle, all_gather_chunks
from megazero.zero.init import GatheredParameters, materialize_init_shard
from megazero.zero.layout import FlatLayout
from megazero.zero.master_partitions import MasterPartitions
from megazero.zero.partition_checkpoint import PartitionCheckpoint
from megazero.zero.shard_buckets import ShardedGradients


def _empty_like(p: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=p.dtype, device=p.device)


class _Shard:
    """One (unit, param group, persistent or not): this rank's chunks of the parameters, of the
    master weights and of the gradients, over a FlatLayout cut into buckets of `bucket_numel`."""

    def __init__(self, params: list[torch.nn.Parameter], group_index: int, group, persistent: bool,
                 bucket_numel: int):
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
        self.grad_partition = torch.zeros(self.layout.partition_numel, dtype=torch.float32, device=self.device)
        self.grad_views = self.layout.split_partition(self.grad_partition)
        self.full: torch.Tensor | None = None
        self._point_params(full)
        if not persistent:
            self.release()

    def _point_params(self, full: torch.Tensor) -> None:
        self.full = full
        for p in self.layout.params:
            offset = self.layout.offsets[p]
            p.data = full[offset:offset + self.layout.numels[p]].view(self.layout.shapes[p])

    def start_gather(self) -> Handle:
        """All-gather the chunks into a new full buffer (one collective per bucket); the parameters
        point into it once waited."""
        full = torch.empty(self.layout.numel, dtype=self.dtype, device=self.device)
        for chunk, own in zip(self.layout.own_chunks(full, self.rank), self.shard_views):
            chunk.copy_(own)
        inner = [all_gather_chunks(full[b.start:b.start + b.numel], self.group, "parameters")
                 for b in self.layout.buckets]
        return Handle(inner, lambda: self._point_params(full))

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
            self.shard.copy_(torch.cat(self.layout.own_chunks(self.full, self.rank)))
            if not self.aliased:
                self.master_flat.copy_(self.shard)


class _Unit:
    """A module whose parameters are gathered and released together."""

    def __init__(self, module: torch.nn.Module, shards: list[_Shard], is_root: bool):
        self.module = module
        self.shards = shards
        self.is_root = is_root
        self.gathered = all(s.persistent for s in shards)
        self.grads_pending = 0
        self.num_params = sum(len(s.layout.params) for s in shards)
        self.numel = sum(s.layout.numel for s in shards if not s.persistent)
        self._pending: list[Handle] = []  # a prefetch in flight

    def prefetch(self) -> bool:
        """Start gathering without waiting (the next gather() waits for it); False if there was nothing to start."""
        if self.gathered or self._pending:
            return False
        self._pending = [s.start_gather() for s in self.shards if not s.persistent]
        return True

    def gather(self) -> None:
        """Make every parameter of the unit whole (no-op when it already is)."""
        if self.gathered:
            return
        self.prefetch()
        for h in self._pending:
            h.wait()
        self._pending = []
        self.gathered = True

    def release(self) -> None:
        """Free the unit's non-persistent full parameters."""
        if self._pending:  # a prefetch that was not used: complete the collective first
            self.gather()
        if not self.gathered or all(s.persistent for s in self.shards):
            return
        for s in self.shards:
            if not s.persistent:
                s.release()
        self.gathered = False


class ShardedState(MasterPartitions, PartitionCheckpoint):
    """ZeRO stage 3 over the optimizer's param groups (a megazero.zero.protocol.DataParallelState;
    checkpoints in the flat_partitions format, the parameters in it: the model file holds none)."""

    stage = 3
    params_partitioned = True

    def __init__(self, model: torch.nn.Module, groups: list[list[torch.nn.Parameter]], group,
                 persistence_threshold: int, prefetch_numel: int = 50_000_000,
                 bucket_numel: int = 500_000_000, overlap: bool = True):
        self.group = group
        self.prefetch_numel = prefetch_numel
        self.prefetches = 0  # gathers started ahead of use (forward: the next unit; backward: the previous)
        self._trace: list[_Unit] = []  # units in the order the first forward ran them
        self._trace_done = False
        self.world_size = dist.get_world_size(group)
        group_of = {id(p): i for i, g in enumerate(groups) for p in g}
        unit_modules = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        unit_roots = [child for mlist in unit_modules for child in mlist]
        in_unit = {id(p) for u in unit_roots for p in u.parameters()}
        plan = [(model, [p for p in model.parameters() if id(p) not in in_unit], True)]
        plan += [(u, list(u.parameters()), False) for u in unit_roots]
        self.units: list[_Unit] = []
        for module, params, is_root in plan:
            shards = []
            for gi in range(len(groups)):
                mine = [p for p in params if group_of.get(id(p)) == gi]
                for p in mine:  # built under zero.Init: whole again, one unit at a time
                    materialize_init_shard(p, group)
                # as in DeepSpeed, parameters under the threshold stay whole (biases, norms: tiny
                # tensors whose gathers would cost more in latency than they save in memory)
                whole = [p for p in mine if p.numel() < persistence_threshold]
                split = [p for p in mine if p.numel() >= persistence_threshold]
                for persistent, these in ((True, whole), (False, split)):
                    if these:
                        shards.append(_Shard(these, gi, group, persistent, bucket_numel))
            unit = _Unit(module, shards, is_root)
            for shard in shards:
                for p in shard.layout.params:
                    p._megazero_unit, p._megazero_shard = unit, shard
            self.units.append(unit)
        # optimizer state index i <-> self.parts[i]: ordered by param group, then unit
        self.parts = sorted((s for u in self.units for s in u.shards), key=lambda s: s.group_index)
        # backward produces the last layer's gradients first and the root's (embeddings) last
        backward_order = [s for u in self.units[:0:-1] + self.units[:1] for s in u.shards]
        device = self.parts[0].device if self.parts else torch.device("cpu")
        self.grads = ShardedGradients(backward_order, bucket_numel, group, self.world_size, dist.get_rank(group),
                                      overlap, device, InflightLimit())
        self._install_hooks()  # after the gradient hooks: a unit is released once its gradients are copied

    # ---- hooks ---------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda mod, args, unit=unit: self._before_forward(unit))
            unit.module.register_forward_hook(lambda mod, args, out, unit=unit: self._after_forward(unit, out))
            for shard in unit.shards:
                for p in shard.layout.params:
                    p.register_post_accumulate_grad_hook(lambda p, unit=unit: self._grad_arrived(unit))

    def _neighbour(self, unit: _Unit, step: int) -> _Unit | None:
        if not self._trace_done or unit.is_root or unit not in self._trace:
            return None
        index = self._trace.index(unit) + step
        return self._trace[index] if 0 <= index < len(self._trace) else None

    def _prefetch(self, unit: _Unit | None) -> None:
        if unit is not None and 0 < unit.numel <= self.prefetch_numel and unit.prefetch():
            self.prefetches += 1

    def _before_forward(self, unit: _Unit) -> None:
        unit.gather()
        if not self._trace_done and not unit.is_root:
            self._trace.append(unit)
        self._prefetch(self._neighbour(unit, +1))  # the next layer's gather overlaps this layer's forward

    def _before_backward(self, unit: _Unit) -> None:
        unit.gather()
        self._prefetch(self._neighbour(unit, -1))  # backward runs the layers in reverse

    def _after_forward(self, unit: _Unit, output) -> None:
        if torch._C._current_autograd_node() is not None:
            return  # activation checkpointing recomputes inside backward: the unit must stay gathered
        if not torch.is_grad_enabled():
            if not unit.is_root:
                unit.release()
            return
        unit.grads_pending = unit.num_params
        if unit.is_root:
            return  # the root stays whole until its gradients are in
        unit.release()
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, unit=unit: self._before_backward(unit))

    def _grad_arrived(self, unit: _Unit) -> None:
        unit.grads_pending -= 1
        if unit.grads_pending == 0:
            unit.release()

    # ---- the engine's interface ------------------------------------------------------------------
    @property
    def bucket_count(self) -> int:
        """Reduce-scatters per micro-step (buckets of reduce_bucket_size elements)."""
        return self.grads.bucket_count

    def begin_micro_step(self, boundary: bool) -> None:
        """Stage 3 reduce-scatters every micro-step, boundary or not."""
        self.grads.start_micro_step()

    def after_backward(self, boundary: bool) -> None:
        """Finish this micro-step's reduce-scatters and free any unit still gathered."""
        if not boundary:
            self.reduce_gradients()

    def reduce_gradients(self) -> None:
        """Wait for every shard's reduce-scatter; release what backward left gathered."""
        self.grads.finish_reduction()
        for unit in self.units:
            unit.release()
        self._trace_done = True

    def copy_targets(self) -> dict[int, torch.Tensor]:
        """{id(master): its 16-bit parameter shard} the optimizer may write in its update pass."""
        return {id(m): v for s in self.parts if not s.aliased for m, v in zip(s.masters, s.shard_views)}

    def update_model(self, copies_written: bool = False) -> None:
        """Cast the masters into the parameter shards (unless the optimizer already did); re-gather
        the persistent ones."""
        with torch.no_grad():
            for s in self.parts:
                if not s.aliased and not copies_written:
                    s.shard.copy_(s.master_flat)
        handles = [s.start_gather() for s in self.parts if s.persistent]
        for h in handles:
            h.wait()

    def reset_masters(self) -> None:
        """Re-read the master shards from the parameter shards."""
        with torch.no_grad():
            for s in self.parts:
                if not s.aliased:
                    s.master_flat.copy_(s.shard)

    def gathered(self, params: list[torch.nn.Parameter]) -> GatheredParameters:
        """The units holding `params` are whole inside it (zero.GatheredParameters)."""
        return GatheredParameters(params)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by kind (shards, and whatever is gathered right now)."""
        params = [s.shard for s in self.parts] + [s.full for s in self.parts if s.full is not None]
        return {"parameters": params, "gradients": [s.grad_partition for s in self.parts],
                "optimizer": [s.master_flat for s in self.parts if not s.aliased]}

    def start_window(self) -> None:
        """Discard gradients and start the next accumulation window."""
        for s in self.parts:
            s.grad_partition.zero_()


def _tensors(output):
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)
