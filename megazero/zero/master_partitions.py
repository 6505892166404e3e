"""What stages 1-3 share: each rank's fp32 master partitions and the reduced gradient partitions."""

from __future__ import annotations

import bisect

import torch
import torch.distributed as dist

from megazero.distributed import all_reduce_sum


class MasterPartitions:
    """Mixin over `self.parts` (and `self.group`). Each part has `.masters`, the fp32 Parameters the
    optimizer updates (this rank's chunks), `.grad_views`, their reduced fp32 gradients, and
    `.layout`; in the optimizer, the masters of all parts follow one another in `self.parts` order.
    A part whose `.grad_sink` is set (optimizer offload to nvme) has its reduced gradients in swap
    files instead (megazero.zero.grad_swap): the state wrapping it answers for them."""

    parts: list
    group: object

    def grad_norm_squared(self, counted=None) -> torch.Tensor:
        """Squared L2 norm of the reduced gradients of the parameters with counted(p) true (all when
        None), summed over every rank's partitions: a float64 scalar, the same on every rank."""
        local = SquaredNormSum()
        for part in self.parts:
            if counted is None:
                local.add(part.grad_views)
            else:
                for view, start, numel in counted_slices(part, counted):
                    local.add([part.grad_views[view][start:start + numel]])
        return all_reduce_sum(local.total(), group=self.group)

    def grad_norm(self, counted=None, model_parallel_group=None) -> float:
        """Global L2 norm of the (loss-scaled) gradients, summed over every rank's partitions (and
        over the model-parallel group, counting only parameters for which counted(p) is true)."""
        total = self.grad_norm_squared(counted)
        if model_parallel_group is not None:
            total = all_reduce_sum(total, group=model_parallel_group)
        return total.item() ** 0.5  # the step's one host sync: it decides skip and clip

    def nonfinite_params(self) -> list[torch.nn.Parameter]:
        """The parameters whose piece of this rank's reduced gradient partition holds an inf or nan
        (for the error that stops a run; other ranks check their own pieces)."""
        found = []
        for part in self.parts:
            offsets = [b.partition_offset for b in part.layout.buckets]
            for frag in part.layout.fragments(part.rank):
                view = bisect.bisect_right(offsets, frag.partition_start) - 1
                start = frag.partition_start - offsets[view]
                if not bool(torch.isfinite(part.grad_views[view][start:start + frag.numel]).all()):
                    found.append(frag.param)
        return found

    def sync_grads(self, params: list[torch.nn.Parameter], group) -> None:
        """Sum the reduced gradients of `params` over `group` (tied weights on other pipeline stages).
        Each must have been isolated in its own layout, so its partitions line up on every stage."""
        wanted = {id(p) for p in params}
        for part in self.parts:
            if any(id(p) in wanted for p in part.layout.params):
                if len(part.layout.params) != 1:
                    raise RuntimeError("a tied parameter shares its ZeRO layout with others: build the state "
                                       "with isolate=[tied parameters]")
                for g in part.grad_views:
                    dist.all_reduce(g, group=group)

    def scale_gradients(self, factor: float) -> None:
        """Multiply the gradient partitions by `factor` (for optimizers that cannot unscale)."""
        for part in self.parts:
            for g in part.grad_views:
                g.mul_(factor)

    def attach_grads(self) -> None:
        """The masters' gradients are the reduced gradient chunks."""
        for part in self.parts:
            for master, grad in zip(part.masters, part.grad_views):
                master.grad = grad

    def detach_grads(self) -> None:
        """Drop the gradient references from the masters."""
        for part in self.parts:
            for master in part.masters:
                master.grad = None

    def optimizer_groups(self, groups: list[dict]) -> list[dict]:
        """One optimizer group per param group that has parameters, over its parts' masters."""
        out = []
        for gi, g in enumerate(groups):
            masters = [m for part in self.parts if part.group_index == gi for m in part.masters]
            if masters:
                out.append({**g, "params": masters})
        return out

    def optimizer_to_step(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """`optimizer` itself: it steps the masters where they are."""
        return optimizer


def add_reduced_gradient(part, index: int, reduced: torch.Tensor) -> None:
    """Add this rank's reduced chunk of layout bucket `index` into `part`'s gradient partition, or
    hand it to the part's `grad_sink` (megazero.zero.grad_swap) when the partition is swapped."""
    if part.grad_sink is None:
        part.grad_views[index].add_(reduced)
    else:
        part.grad_sink.add(part, index, reduced)


def master_partition(part) -> torch.Tensor:
    """A part's masters as one flat partition (padding included), for checkpoints."""
    return torch.cat([m.detach().reshape(-1) for m in part.masters])


def load_master_partition(part, flat: torch.Tensor) -> None:
    """Inverse of master_partition()."""
    views = part.layout.split_partition(flat)
    with torch.no_grad():
        for master, view in zip(part.masters, views):
            master.copy_(view.view_as(master))


def counted_slices(part, counted) -> list[tuple[int, int, int]]:
    """(grad view index, start, numel) of the pieces of `part`'s gradient partition that belong to
    parameters with counted(p) true (computed once per part)."""
    cached = getattr(part, "_counted_slices", None)
    if cached is None:
        offsets = [b.partition_offset for b in part.layout.buckets]
        cached = []
        for frag in part.layout.fragments(part.rank):
            if counted(frag.param):
                view = bisect.bisect_right(offsets, frag.partition_start) - 1
                cached.append((view, frag.partition_start - offsets[view], frag.numel))
        part._counted_slices = cached
    return cached


def squared_norm(t: torch.Tensor) -> float:
    """Squared L2 norm (inf/nan propagate), without materialising a float64 copy; on CPU by the
    fused one-pass kernel of megazero.ops when it is available."""
    if t.device.type == "cpu":
        from megazero.ops.cpu_optimizers import grad_norm_squared

        return grad_norm_squared([t])
    return float(torch.linalg.vector_norm(t)) ** 2


class SquaredNormSum:
    """Adds up squared L2 norms of gradient tensors (inf/nan propagate) without reading any back:
    CPU tensors by squared_norm (the fused one-pass kernel) into a float, GPU tensors with one
    fused norm kernel per add() into a float64 scalar on their device; total() joins the two."""

    def __init__(self):
        self.cpu = 0.0
        self.on_device: torch.Tensor | None = None
        self._has_cpu = False

    def add(self, tensors: list[torch.Tensor]) -> None:
        """Add the squared norms of `tensors`."""
        cpu = [t for t in tensors if t.device.type == "cpu"]
        if cpu:
            self.cpu += sum(squared_norm(t) for t in cpu)
            self._has_cpu = True
        other = [t for t in tensors if t.device.type != "cpu"]
        if other:
            part = squared_norms_on_device(other)
            self.on_device = part if self.on_device is None else self.on_device + part

    def total(self) -> torch.Tensor:
        """The sum as a float64 scalar, on the GPU when any tensor was there (else the CPU)."""
        if self.on_device is None:
            return torch.tensor(self.cpu, dtype=torch.float64)
        if not self._has_cpu:
            return self.on_device
        # a fill kernel takes the float as an argument: no host-to-device copy to wait for
        return self.on_device + torch.full((), self.cpu, dtype=torch.float64, device=self.on_device.device)


def squared_norms_on_device(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of the tensors' squared L2 norms as a float64 scalar where they are: one fused norm
    kernel (each norm in the tensor's dtype, as torch's vector norm), squared and summed in float64."""
    norms = torch.stack(torch._foreach_norm(tensors)).double()
    return (norms * norms).sum()
