"""What stages 1-3 share: each rank's fp32 master partitions and the reduced gradient partitions."""

from __future__ import annotations

import torch

from megazero.distributed import all_reduce_values


class MasterPartitions:
    """Mixin over `self.parts` (and `self.group`). Each part has `.masters`, the fp32 Parameters the
    optimizer updates (this rank's chunks), `.grad_views`, their reduced fp32 gradients, and
    `.layout`; in the optimizer, the masters of all parts follow one another in `self.parts` order."""

    parts: list
    group: object

    def grad_norm(self) -> float:
        """Global L2 norm of the (loss-scaled) gradients, summed over every rank's partitions."""
        local = sum(float(torch.sum(g.double() ** 2)) for part in self.parts for g in part.grad_views)
        return all_reduce_values([local], group=self.group)[0] ** 0.5

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


def master_partition(part) -> torch.Tensor:
    """A part's masters as one flat partition (padding included), for checkpoints."""
    return torch.cat([m.detach().reshape(-1) for m in part.masters])


def load_master_partition(part, flat: torch.Tensor) -> None:
    """Inverse of master_partition()."""
    views = part.layout.split_partition(flat)
    with torch.no_grad():
        for master, view in zip(part.masters, views):
            master.copy_(view.view_as(master))
