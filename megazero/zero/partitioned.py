"""ZeRO stages 1 and 2: fp32 master weights and optimizer states partitioned over data-parallel ranks.

Per optimizer param group, parameters live in one flat buffer (model dtype) laid out by a
FlatLayout; each rank owns one chunk of every bucket, and the optimizer updates one fp32 master
tensor per owned chunk, so it (and its states) cover 1/N of the model. For an fp32 model the
masters are the owned chunks of the flat parameters themselves; for bf16/fp16 they are fp32 copies.

Stage 1 keeps a full fp32 gradient buffer, accumulates locally, and on the boundary reduce-scatters
each bucket as it fills; the masters' gradients are the owned chunks of that buffer. Stage 2
borrows a bucket-sized buffer per bucket, reduce-scatters every micro-step into an fp32 gradient
partition, and drops the buffer: no rank holds the whole gradient. After the optimizer step every
rank casts its masters into its chunks (16-bit) and the buckets are all-gathered in place.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megazero.zero.averaging import AVERAGE_THEN_SUM, GradientAveraging
from megazero.zero.buckets import BucketedGradients, InflightLimit
from megazero.zero.collectives import Handle, all_gather_chunks, reduce_scatter_chunks
from megazero.zero.gathering import DEFAULT_GATHERING, ParameterGathering
from megazero.zero.layout import Bucket, FlatLayout
from megazero.zero.master_partitions import MasterPartitions, add_reduced_gradient
from megazero.zero.partition_checkpoint import PartitionCheckpoint


class _GroupPartition:
    """One optimizer param group: its layout, flat parameters, master and gradient chunks."""

    def __init__(self, params: list[torch.nn.Parameter], group_index: int, stage: int, group, bucket_numel: int,
                 overlap: bool, inflight: InflightLimit, grad_divisor: int | None = None,
                 averaging: GradientAveraging = AVERAGE_THEN_SUM,
                 gathering: ParameterGathering = DEFAULT_GATHERING):
        self.group_index = group_index
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.layout = FlatLayout(params, bucket_numel, self.world_size)
        dtype, device = params[0].dtype, params[0].device
        self.flat_params = torch.zeros(self.layout.numel, dtype=dtype, device=device)
        with torch.no_grad():
            for p in params:
                offset = self.layout.offsets[p]
                view = self.flat_params[offset:offset + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view  # the model's parameters now live in the flat buffer
        own = self.layout.own_chunks(self.flat_params, self.rank)
        # an fp32 model's own chunks are the master weights themselves: no copy, nothing to cast back
        self.aliased = dtype == torch.float32
        self.master_deferred = False  # (stage 3's swapped shards may defer their masters; these never)
        if self.aliased:
            self.master_flat = None
            self.masters = [torch.nn.Parameter(chunk) for chunk in own]
        else:
            self.master_flat = torch.cat(own).float()
            self.masters = [torch.nn.Parameter(view) for view in self.layout.split_partition(self.master_flat)]
        self.stage = stage
        self.grads = BucketedGradients(self.layout, self._reduce_scatter, self.world_size, overlap,
                                       staged=stage == 2, device=device, inflight=inflight, divisor=grad_divisor,
                                       averaging=averaging)
        self.gathering = gathering
        if stage == 1:  # reduced gradients stay in the full buffer: this rank's chunk of each bucket
            self.grad_partition = None
            self.grad_views = self.layout.own_chunks(self.grads.buffer, self.rank)
        else:
            self.grad_partition = torch.zeros(self.layout.partition_numel, dtype=torch.float32, device=device)
            self.grad_views = self.layout.split_partition(self.grad_partition)
        self.grad_sink = None  # stage 2 with optimizer offload to nvme: megazero.zero.grad_swap

    def _reduce_scatter(self, bucket: Bucket, tensor: torch.Tensor) -> Handle:
        inner = reduce_scatter_chunks(tensor, self.group, f"gradient bucket {bucket.index}")
        mine = tensor.view(self.world_size, -1)[self.rank]
        after = self.grads.after
        if self.stage == 1:  # the reduced chunk is already where the master's gradient view points
            return inner if after == 1 else Handle([inner], lambda: mine.mul_(after))

        def finish() -> None:
            if after != 1:
                mine.mul_(after)
            add_reduced_gradient(self, bucket.index, mine)

        return Handle([inner], finish)

    def copy_targets(self) -> dict[int, torch.Tensor]:
        """{id(master chunk): this rank's 16-bit chunk of the flat parameters} (empty when aliased)."""
        if self.aliased:
            return {}
        return {id(m): self.flat_params[slice(*self.layout.rank_range(b, self.rank))]
                for b, m in zip(self.layout.buckets, self.masters)}

    def master_values(self, index: int) -> torch.Tensor:
        """Master `index` itself (never deferred)."""
        return self.masters[index].data

    def partition_loaded(self) -> contextlib.nullcontext:
        """Nothing to load: the flat parameters never leave memory."""
        return contextlib.nullcontext()

    def write_master(self, index: int, first: bool, last: bool) -> None:
        """Cast master `index` into this rank's chunk of the flat parameters (update_model then
        all-gathers them with copies_written)."""
        with torch.no_grad():
            self.flat_params[slice(*self.layout.rank_range(self.layout.buckets[index], self.rank))].copy_(
                self.masters[index])

    def gather_params(self, copies_written: bool = False) -> list[Handle]:
        """Cast the master chunks into the flat parameters (unless the optimizer already wrote them)
        and start the all-gather of every bucket."""
        handles = []
        with torch.no_grad():
            for b, master in zip(self.layout.buckets, self.masters):
                if not self.aliased and not copies_written:
                    self.flat_params[slice(*self.layout.rank_range(b, self.rank))].copy_(master)
                handles.append(all_gather_chunks(self.flat_params[b.start:b.start + b.numel], self.group, "parameters",
                                                 self.gathering.bucket_numel, self.gathering.broadcasts))
        return handles

    def reset_masters(self) -> None:
        """Re-read the masters from the flat parameters."""
        if not self.aliased:
            with torch.no_grad():
                for master, chunk in zip(self.masters, self.layout.own_chunks(self.flat_params, self.rank)):
                    master.copy_(chunk)


class PartitionedState(MasterPartitions, PartitionCheckpoint):
    """ZeRO stage 1 or 2 over the optimizer's param groups (a megazero.zero.protocol.DataParallelState;
    checkpoints in the flat_partitions format)."""

    params_partitioned = False
    params_in_swap = False  # (the parameters never leave memory)

    def __init__(self, groups: list[list[torch.nn.Parameter]], group, bucket_numel: int, overlap: bool,
                 stage: int, isolate: list[torch.nn.Parameter] = (), grad_divisor: int | None = None,
                 averaging: GradientAveraging = AVERAGE_THEN_SUM,
                 gathering: ParameterGathering = DEFAULT_GATHERING):
        # grad_divisor: what the summed gradients are divided by (default: the group's size)
        if stage not in (1, 2):
            raise ValueError(f"PartitionedState handles ZeRO stages 1 and 2, got {stage}")
        self.stage = stage
        self.group = group
        self.world_size = dist.get_world_size(group)
        inflight = InflightLimit()  # shared: bounds stage 2's staging buffers over all groups
        # each isolated parameter (a tied weight) gets a layout of its own: identical on every stage
        alone = {id(p) for p in isolate}
        plan = []
        for gi, g in enumerate(groups):
            plan.append(([p for p in g if id(p) not in alone], gi))
            plan += [([p], gi) for p in g if id(p) in alone]
        self.parts = [_GroupPartition(params, gi, stage, group, bucket_numel, overlap, inflight, grad_divisor,
                                     averaging, gathering)
                      for params, gi in plan if params]

    @property
    def gradients_partitioned(self) -> bool:
        """Stage 2: each part's reduced gradients are a partition of their own; stage 1: views of
        the full gradient buffer."""
        return self.stage == 2

    @property
    def bucket_count(self) -> int:
        """Buckets over all param groups."""
        return sum(part.grads.bucket_count for part in self.parts)

    def begin_micro_step(self, boundary: bool, defer: bool = False) -> None:
        """Stage 1 communicates on the boundary only; stage 2 on every micro-step; neither when the
        gradients are deferred (stage 2 then keeps them in its staging buffers until the step)."""
        for part in self.parts:
            part.grads.sync_this_micro_step = (boundary or self.stage == 2) and not defer

    def after_backward(self, boundary: bool, defer: bool = False) -> None:
        """Stage 2: finish this micro-step's reduce-scatter, so the staging buffers are free again."""
        if self.stage == 2 and not boundary and not defer:
            for part in self.parts:
                part.grads.finish_reduction()

    def reduce_gradients(self) -> None:
        """Finish every bucket's reduce-scatter: each rank now holds its reduced gradient partition."""
        for part in self.parts:
            part.grads.finish_reduction()

    def copy_targets(self) -> dict[int, torch.Tensor]:
        """{id(master): 16-bit tensor} the optimizer may write in its update pass."""
        return {k: v for part in self.parts for k, v in part.copy_targets().items()}

    def update_model(self, copies_written: bool = False) -> None:
        """All-gather the updated parameters into every rank's model."""
        handles = [h for part in self.parts for h in part.gather_params(copies_written)]
        for handle in handles:
            handle.wait()

    def reset_masters(self) -> None:
        """Re-read the masters from the model (after loading model weights only)."""
        for part in self.parts:
            part.reset_masters()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by kind (for memory reports)."""
        grads = [part.grad_partition for part in self.parts if part.grad_partition is not None]
        grads += [part.grads.buffer for part in self.parts if part.grads.buffer is not None]
        masters = [m for part in self.parts if not part.aliased for m in part.masters]
        return {"parameters": [part.flat_params for part in self.parts], "gradients": grads, "optimizer": masters}

    def start_window(self) -> None:
        """Discard gradients and start the next accumulation window."""
        for part in self.parts:
            part.grads.start_window()
            if part.grad_partition is not None:
                part.grad_partition.zero_()
