"""Which routing assignments an expert keeps: its capacity, and token dropping by global order.

A routing assignment is one (token, expert) choice of the router; T tokens make T*k of them.
Capacity mode (`capacity_factor` c): each expert keeps at most ceil(c * T * k / E) assignments,
with T the tokens of the whole expert-parallel group; the rest are dropped (the token gets
nothing from that expert; its residual carries it on). Dropless mode (c None) keeps them all.

Which ones an expert keeps is defined by the GLOBAL order of the tokens: the order of the batch
made by concatenating the EP ranks' tokens, rank 0's first (each rank's tokens in their own
order). Expert e keeps its first `capacity` assignments in that order. Each rank decides for its
own tokens from the per-expert assignment counts of every rank (one all-gather, done by the
caller): the assignments of earlier ranks come first, so a local assignment at position p among
this rank's assignments to e is at global position offset_e + p, offset_e being the count of
earlier ranks' assignments to e. The single process on the concatenated batch has offset 0 and
the same positions, so it drops exactly the same tokens as an EP run. The all-gathered counts
also give every rank the kept counts of every (rank, expert) pair: the split sizes of both
all-to-alls, with no further exchange.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float | None) -> int | None:
    """ceil(capacity_factor * num_tokens * topk / num_experts), or None (dropless) when the factor is None."""
    if capacity_factor is None:
        return None
    if capacity_factor <= 0:
        raise ValueError(f"moe capacity_factor must be positive or None (dropless), got {capacity_factor}")
    return math.ceil(capacity_factor * num_tokens * topk / num_experts)


@dataclass
class DispatchPlan:
    """The assignments this rank sends, and the kept counts of every rank.

    order: [A] indices into this rank's flattened assignments (token-major: assignment t*k + s
        is token t's s-th choice), the kept ones sorted by expert, each expert's in token order.
    kept: [EP, E] kept assignments of each rank to each expert.
    routed: [EP, E] assignments of each rank to each expert before dropping.
    capacity: per-expert capacity (None: dropless).
    """

    order: torch.Tensor
    kept: torch.Tensor
    routed: torch.Tensor
    capacity: int | None


def plan_dispatch(experts: torch.Tensor, routed: torch.Tensor, rank: int,
                  capacity_factor: float | None) -> DispatchPlan:
    """The dispatch plan of this rank (`rank` in the EP group) from its router choices `experts`
    [T, k] and every rank's assignment counts `routed` [EP, E] (all-gathered, rank order)."""
    num_experts, topk = routed.shape[1], experts.shape[1]
    num_tokens = int(routed.sum()) // topk  # tokens of the whole EP group
    capacity = expert_capacity(num_tokens, topk, num_experts, capacity_factor)
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # by expert; within an expert, in token order
    if capacity is None:
        return DispatchPlan(order=order, kept=routed.clone(), routed=routed, capacity=None)
    by_expert = flat[order]
    local = routed[rank]
    first = torch.cumsum(local, 0) - local  # where each expert's assignments start in `order`
    position = torch.arange(flat.numel(), device=flat.device) - first[by_expert]  # among this rank's
    earlier = torch.cumsum(routed, 0) - routed  # [EP, E]: assignments of the earlier ranks
    keep = earlier[rank][by_expert] + position < capacity
    kept = torch.minimum(routed, (capacity - earlier).clamp(min=0))
    return DispatchPlan(order=order[keep], kept=kept, routed=routed, capacity=capacity)
