"""Token dispatch to the EP ranks that hold the chosen experts, and the combine back.

With E experts over EP ranks, rank j holds experts [j*E/EP, (j+1)*E/EP). Given a DispatchPlan
(megazero/moe/capacity.py), `dispatch` sends each kept assignment's token to the rank of its
expert with one all-to-all and returns the received rows grouped by local expert (each expert's
rows in global token order: source rank 0's first); `combine` sends the expert outputs back with
the reverse all-to-all and sums each token's outputs weighted by its router weights. The split
sizes of both come from the plan's all-gathered kept counts. Both all-to-alls are autograd
functions (megazero/moe/comm.py), so gradients flow back to the tokens and the router weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megazero.moe.capacity import DispatchPlan
from megazero.moe.comm import all_to_all, group_rank, group_size


@dataclass
class Dispatched:
    """What combine needs to undo a dispatch. rows_per_expert: [E_local] rows each local expert got."""

    plan: DispatchPlan
    send_splits: list[int]
    recv_splits: list[int]
    regroup: torch.Tensor  # received rows (source-rank-major) -> local-expert-major
    rows_per_expert: list[int]
    topk: int
    ep_group: object


def dispatch(x: torch.Tensor, plan: DispatchPlan, topk: int, ep_group) -> tuple[torch.Tensor, Dispatched]:
    """x [T, hidden] -> (rows [N, hidden] grouped by local expert, state for combine)."""
    ep, rank = group_size(ep_group), group_rank(ep_group)
    num_local = plan.kept.shape[1] // ep
    kept = plan.kept.view(ep, ep, num_local)  # [source rank, destination rank, local expert]
    send_splits = kept[rank].sum(1).tolist()
    received = kept[:, rank]  # [source rank, my local expert]
    recv_splits = received.sum(1).tolist()
    # one row per assignment (token-major), then the kept ones: every index below is unique, so
    # the backward has no scatter-add with collisions (deterministic on GPUs too); a token's k
    # copies are summed by expand's backward
    per_assignment = x.unsqueeze(1).expand(-1, topk, -1).reshape(-1, x.shape[1])
    rows = all_to_all(per_assignment[plan.order], recv_splits, send_splits, ep_group, "dispatch")
    # received rows are source-major, expert-minor; a stable sort by expert keeps the source order
    expert_of_row = torch.arange(num_local, device=x.device).repeat(ep).repeat_interleave(received.flatten())
    regroup = torch.sort(expert_of_row, stable=True).indices
    state = Dispatched(plan=plan, send_splits=send_splits, recv_splits=recv_splits, regroup=regroup,
                       rows_per_expert=received.sum(0).tolist(), topk=topk, ep_group=ep_group)
    return rows[regroup], state


def combine(rows: torch.Tensor, weights: torch.Tensor, num_tokens: int, state: Dispatched) -> torch.Tensor:
    """Expert outputs `rows` [N, hidden] (in dispatch's order) -> [T, hidden]: each token's
    outputs times its router weights [T, k], summed; dropped assignments add nothing."""
    back = torch.empty_like(state.regroup)
    back[state.regroup] = torch.arange(state.regroup.numel(), device=rows.device)
    sent = all_to_all(rows[back], state.send_splits, state.recv_splits, state.ep_group, "combine")
    order = state.plan.order
    scaled = sent * weights.reshape(-1)[order].unsqueeze(1).to(sent.dtype)
    # each assignment into its own slot (unique indices), then a fixed-order sum over the k slots:
    # deterministic, and the same summation order at every EP size
    slots = sent.new_zeros((num_tokens * state.topk, rows.shape[1])).index_copy(0, order, scaled)
    return slots.view(num_tokens, state.topk, -1).sum(1)
