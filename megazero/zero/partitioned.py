"""ZeRO stages 1 and 2: fp32 master weights and optimizer states partitioned over data-parallel ranks.

Per optimizer param group, parameters live in one flat buffer (model dtype) laid out by a
FlatLayout; each rank owns one chunk of every bucket. The rank's fp32 master partition is a single
flat tensor, so the optimizer (and its states) cover 1/N of the model.

Stage 1 keeps a full fp32 gradient buffer, accumulates locally, and on the boundary reduce-scatters
each bucket as it fills. Stage 2 borrows a bucket-sized buffer per bucket, reduce-scatters every
micro-step into the fp32 gradient partition, and returns the buffer: no rank holds the whole
gradient. After the optimizer step every rank casts its chunks into the flat parameter buffer and
the buckets are all-gathered in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.distributed import all_reduce_values
from megazero.zero.buckets import BucketedGradients, InflightLimit
from megazero.zero.collectives import Handle, all_gather_chunks, reduce_scatter_chunks
from megazero.zero.layout import Bucket, FlatLayout


class _GroupPartition:
    """One optimizer param group: its layout, flat parameters, master and gradient partitions."""

    def __init__(self, params: list[torch.nn.Parameter], stage: int, group, bucket_numel: int, overlap: bool,
                 inflight: InflightLimit):
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
        self.master = torch.nn.Parameter(self._own_chunks(self.flat_params).float())
        self.grad_partition = torch.zeros(self.layout.partition_numel, dtype=torch.float32, device=device)
        self.grads = BucketedGradients(self.layout, self._reduce_scatter, self.world_size, overlap,
                                       staged=stage == 2, device=device, inflight=inflight)

    def _own_chunks(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.cat([flat[slice(*self.layout.rank_range(b, self.rank))] for b in self.layout.buckets])

    def _partition_slice(self, bucket: Bucket) -> torch.Tensor:
        chunk = bucket.chunk(self.world_size)
        return self.grad_partition[bucket.partition_offset:bucket.partition_offset + chunk]

    def _reduce_scatter(self, bucket: Bucket, tensor: torch.Tensor) -> Handle:
        inner = reduce_scatter_chunks(tensor, self.group)
        mine = tensor.view(self.world_size, -1)[self.rank]
        return Handle([inner], lambda: self._partition_slice(bucket).add_(mine))

    def gather_params(self) -> list[Handle]:
        """Cast the master chunks into the flat parameters and start the all-gather of every bucket."""
        handles = []
        with torch.no_grad():
            for b in self.layout.buckets:
                lo, hi = self.layout.rank_range(b, self.rank)
                chunk = b.chunk(self.world_size)
                self.flat_params[lo:hi].copy_(self.master[b.partition_offset:b.partition_offset + chunk])
                handles.append(all_gather_chunks(self.flat_params[b.start:b.start + b.numel], self.group))
        return handles


class PartitionedState:
    """ZeRO stage 1 or 2 over the optimizer's param groups (same interface as ReplicatedState)."""

    def __init__(self, groups: list[list[torch.nn.Parameter]], group, bucket_numel: int, overlap: bool,
                 stage: int):
        if stage not in (1, 2):
            raise ValueError(f"PartitionedState handles ZeRO stages 1 and 2, got {stage}")
        self.stage = stage
        self.group = group
        self.world_size = dist.get_world_size(group)
        inflight = InflightLimit()  # shared: bounds stage 2's staging buffers over all groups
        self.parts = [_GroupPartition(g, stage, group, bucket_numel, overlap, inflight) for g in groups if g]
        self._part_of = {id(p): part for part in self.parts for p in part.layout.params}

    def optimizer_groups(self, groups: list[dict]) -> list[dict]:
        """One flat fp32 master partition per param group."""
        out = []
        for g in groups:
            if not g["params"]:
                continue
            part = self._part_of[id(g["params"][0])]
            out.append({**g, "params": [part.master]})
        return out

    @property
    def bucket_count(self) -> int:
        """Buckets over all param groups."""
        return sum(part.grads.bucket_count for part in self.parts)

    def begin_micro_step(self, boundary: bool) -> None:
        """Stage 1 communicates on the boundary only; stage 2 on every micro-step."""
        for part in self.parts:
            part.grads.sync_this_micro_step = boundary or self.stage == 2

    def after_backward(self, boundary: bool) -> None:
        """Stage 2: finish this micro-step's reduce-scatter, so the staging buffers are free again."""
        if self.stage == 2 and not boundary:
            for part in self.parts:
                part.grads.finish_reduction()

    def reduce_gradients(self) -> None:
        """Finish every bucket's reduce-scatter: each rank now holds its reduced gradient partition."""
        for part in self.parts:
            part.grads.finish_reduction()

    def grad_norm(self) -> float:
        """Global L2 norm of the (loss-scaled) gradients, summed over the partitions."""
        local = sum(float(torch.sum(part.grad_partition.double() ** 2)) for part in self.parts)
        return all_reduce_values([local], group=self.group)[0] ** 0.5

    def scale_gradients(self, factor: float) -> None:
        """Multiply the gradient partitions by `factor`."""
        for part in self.parts:
            part.grad_partition.mul_(factor)

    def attach_grads(self) -> None:
        """The master partitions' gradients are the reduced gradient partitions."""
        for part in self.parts:
            part.master.grad = part.grad_partition

    def detach_grads(self) -> None:
        """Drop the gradient references from the master partitions."""
        for part in self.parts:
            part.master.grad = None

    def update_model(self) -> None:
        """All-gather the updated parameters into every rank's model."""
        handles = [h for part in self.parts for h in part.gather_params()]
        for handle in handles:
            handle.wait()

    def reset_masters(self) -> None:
        """Re-read the master partitions from the model (after loading model weights only)."""
        with torch.no_grad():
            for part in self.parts:
                part.master.copy_(part._own_chunks(part.flat_params))

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by kind (for memory reports)."""
        grads = [part.grad_partition for part in self.parts]
        grads += [part.grads.buffer for part in self.parts if part.grads.buffer is not None]
        return {"parameters": [part.flat_params for part in self.parts], "gradients": grads,
                "optimizer": [part.master for part in self.parts]}

    def start_window(self) -> None:
        """Discard gradients and start the next accumulation window."""
        for part in self.parts:
            part.grads.start_window()
            part.grad_partition.zero_()
