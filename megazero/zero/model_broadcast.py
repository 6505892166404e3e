"""Every data-parallel replica starts from the same model: data-parallel rank 0's parameters.

torch seeds each process differently, so a model built without a common seed differs from rank to
rank; at stage 0 the replicas would then train apart for ever, and at stages 1-3 each rank's
partition would come from another model. DeepSpeed's engine broadcasts the model at start for the
same reason. Dense tensors go over the data-parallel group, expert parameters over the
expert-data-parallel group (the ranks that hold the same experts), one coalesced broadcast per
group and dtype. Parameters `zero.Init` already partitioned are left alone: `zero.Init` broadcasts
each parameter before it keeps its slice (megazero.zero.init).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megazero.model_contract import is_expert_parameter


def broadcast_from_first_rank(tensors: list[torch.Tensor], group) -> None:
    """Overwrite `tensors` with the group's first rank's values, in one broadcast per dtype and device."""
    if group is None or dist.get_world_size(group) == 1 or not tensors:
        return
    src = dist.get_global_rank(group, 0)
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for same in by_kind.values():
        if len(same) == 1 and same[0].is_contiguous():  # no flat copy (zero.Init's one parameter at a time)
            dist.broadcast(same[0], src, group=group)
            continue
        flat = _flatten_dense_tensors(same)
        dist.broadcast(flat, src, group=group)
        for t, value in zip(same, _unflatten_dense_tensors(flat, same)):
            t.copy_(value)


@torch.no_grad()
def broadcast_model(model: torch.nn.Module, dp_group, expert_dp_group=None) -> None:
    """Give every data-parallel rank data-parallel rank 0's parameters (expert parameters: the first
    rank of `expert_dp_group`, or of `dp_group` when that is None)."""
    if not dist.is_initialized():
        return
    dense, experts = [], []
    for p in model.parameters():
        if p.numel() == 0 or p.is_meta or hasattr(p, "_megazero_init_shape"):  # zero.Init's partitions
            continue
        (experts if is_expert_parameter(p) else dense).append(p.data)
    broadcast_from_first_rank(dense, dp_group if dp_group is not None else dist.group.WORLD)
    if experts:
        group = expert_dp_group if expert_dp_group is not None else dp_group
        broadcast_from_first_rank(experts, group if group is not None else dist.group.WORLD)
