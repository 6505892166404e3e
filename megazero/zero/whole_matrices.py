"""Whole matrices for an optimizer whose update reads them (Muon, megazero.optim.muon): the
orthogonalizer bound to it for each data-parallel state, which assembles every weight's U from the
pieces the masters hold, orthogonalises it on one owner rank and hands each rank its piece back.

- Tensor parallelism: a weight split over the TP group is all-gathered over it (its stride blocks
  merged: `partition_stride`), orthogonalised per logical matrix, and each TP rank keeps its shard.
  Every TP rank of a data-parallel position owns the same weights, so their gathers pair up.
- Owners: the weights of one param group, in the masters' order, are owned round-robin by the
  data-parallel ranks, so each rank orthogonalises about 1/N of them.
- Stage 0 (ReplicatedState): every rank holds every U whole; owners orthogonalise theirs and one
  all-reduce over the data-parallel group (of a buffer that is zero outside each owner's weights,
  so the sum is exact) gives every rank every update.
- Stages 1-3 (a PartitionedMasters state): each master is this rank's chunk of one bucket of a
  flat layout. Per bucket, the U chunks are all-gathered into the whole bucket, owners write the
  updates of their weights into a zero bucket, and a reduce-scatter gives each rank its chunk.
  The bucket (one reduce_bucket_size) is the most this adds to a rank's memory at a time.

- Expert parallelism (ExpertParallelState): its dense state's masters as above over the
  data-parallel group, its expert state's over the expert-data-parallel group (the ranks holding
  the same experts); an expert weight is a stack of its experts' matrices, each orthogonalised
  alone, so a matrix is never gathered over ranks that hold other experts.

Optimizer offload (OffloadedState: NVMe, or host memory on a GPU) steps sub-groups one by one,
masters this does not assemble: refused (build_orthogonalizer names the combination).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.tensor_parallel.utils import merge_shards, shard_of
from megazero.zero.collectives import all_gather_chunks, all_reduce, reduce_scatter_chunks
from megazero.zero.expert_parallel import ExpertParallelState
from megazero.zero.partitioned import PartitionedState
from megazero.zero.protocol import PartitionedMasters
from megazero.zero.replicated import ReplicatedState
from megazero.zero.sharded import ShardedState


class TensorParallelWhole:
    """Muon's update of one weight from this TP rank's shard of its U: gathered, orthogonalised
    whole (per stride block), and cut back to this rank's shard."""

    def __init__(self, tp_group, orthogonalize):
        self.tp_group = tp_group
        self.world = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
        self.rank = dist.get_rank(tp_group) if self.world > 1 else 0
        self.orthogonalize = orthogonalize

    def __call__(self, param: torch.nn.Parameter, update: torch.Tensor, group: dict) -> torch.Tensor:
        dim, stride = getattr(param, "partition_dim", None), getattr(param, "partition_stride", 1)
        if self.world == 1 or dim is None:
            return self.orthogonalize(update, group, dim, stride)
        shards = [torch.empty_like(update) for _ in range(self.world)]
        dist.all_gather(shards, update.contiguous(), group=self.tp_group)
        whole = self.orthogonalize(merge_shards(shards, dim, stride), group, dim, stride)
        return shard_of(whole, dim, self.world, self.rank, stride).contiguous()


class ReplicatedMatrices:
    """Stage 0: the masters are whole (TP-local) weights (see the module doc)."""

    def __init__(self, state, whole: TensorParallelWhole):
        self.group = state.group
        self.world = dist.get_world_size(state.group)
        self.rank = dist.get_rank(state.group)
        # 16-bit models' masters are fp32 copies: the model parameter carries the TP attributes
        self.param_of = {id(m): p for m, p in zip(state.master.params, state.master.model_params)}
        self.whole = whole

    def holds(self, master: torch.nn.Parameter) -> bool:
        """Whether `master` is one of this state's."""
        return id(master) in self.param_of

    def __call__(self, items: list[tuple[torch.nn.Parameter, torch.Tensor]], group: dict) -> list[torch.Tensor]:
        if self.world == 1:
            return [self.whole(self.param_of[id(m)], u, group) for m, u in items]
        flat = torch.zeros(sum(u.numel() for _, u in items), dtype=torch.float32, device=items[0][1].device
                           if items else None)
        outs, offset = [], 0
        for index, (master, u) in enumerate(items):
            view = flat[offset:offset + u.numel()].view_as(u)
            if index % self.world == self.rank:
                view.copy_(self.whole(self.param_of[id(master)], u, group))
            outs.append(view)
            offset += u.numel()
        all_reduce(flat, self.group, "Muon updates").wait()
        return outs


class PartitionedMatrices:
    """Stages 1-3: each master is this rank's chunk of one bucket (see the module doc)."""

    def __init__(self, state: PartitionedMasters, whole: TensorParallelWhole):
        self.group = state.group
        self.world = dist.get_world_size(state.group)
        self.rank = dist.get_rank(state.group)
        self.where = {id(m): (part, index) for part in state.parts for index, m in enumerate(part.masters)}
        self.whole = whole

    def holds(self, master: torch.nn.Parameter) -> bool:
        """Whether `master` is one of this state's."""
        return id(master) in self.where

    def __call__(self, items: list[tuple[torch.nn.Parameter, torch.Tensor]], group: dict) -> list[torch.Tensor]:
        owner = 0
        outs = []
        for master, u in items:
            part, index = self.where[id(master)]
            layout = part.layout
            bucket = layout.buckets[index]
            full = torch.zeros(bucket.numel, dtype=torch.float32, device=u.device)
            full.view(self.world, -1)[self.rank].copy_(u)
            all_gather_chunks(full, self.group, f"Muon momentum of bucket {index}").wait()
            out = torch.zeros_like(full)
            for p in bucket.params:
                begin = layout.offsets[p] - bucket.start
                end = begin + layout.numels[p]
                if owner % self.world == self.rank:
                    whole_u = full[begin:end].view(layout.shapes[p])
                    out[begin:end] = self.whole(p, whole_u, group).reshape(-1)
                owner += 1
            reduce_scatter_chunks(out, self.group, f"Muon updates of bucket {index}").wait()
            outs.append(out.view(self.world, -1)[self.rank].clone())
        return outs


class ExpertParallelMatrices:
    """The dense and the expert state's orthogonalizers: a param group's masters are all dense or all
    expert (ExpertParallelState keeps them in separate groups), so each call goes to one of them."""

    def __init__(self, inner: list):
        self.inner = inner

    def __call__(self, items: list[tuple[torch.nn.Parameter, torch.Tensor]], group: dict) -> list[torch.Tensor]:
        if not items:
            return []
        return next(o for o in self.inner if o.holds(items[0][0]))(items, group)


def build_orthogonalizer(state, tp_group, orthogonalize):
    """The orthogonalizer for `state` (a data-parallel state) and `tp_group`; `orthogonalize(whole,
    group, partition_dim, stride)` is the optimizer's update of one whole weight. ValueError for
    states whose masters it cannot assemble."""
    whole = TensorParallelWhole(tp_group, orthogonalize)
    if isinstance(state, ReplicatedState):
        return ReplicatedMatrices(state, whole)
    if isinstance(state, (PartitionedState, ShardedState)):
        return PartitionedMatrices(state, whole)
    if isinstance(state, ExpertParallelState):
        return ExpertParallelMatrices([build_orthogonalizer(s, tp_group, orthogonalize)
                                       for s in (state.dense, state.expert) if s is not None])
    raise ValueError(f"Muon with zero_optimization.offload_optimizer ({type(state).__name__}): Muon's update "
                     f"orthogonalises whole matrices, and offload steps sub-groups one by one from host memory or "
                     f"nvme; use ZeRO stages 0-3 without offload_optimizer, or AdamW")
