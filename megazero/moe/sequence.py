"""The MoE layer under sequence parallelism: the whole sequence in, this rank's slice out.

    x = gather_sequence(x, tp_group)     # [b, s/TP, h] -> [b, s, h];  backward: this rank's slice
    y = moe(x)                           # the TP-inside-experts layer on the whole sequence
    y = split_sequence(y, tp_group)      # [b, s, h] -> [b, s/TP, h];  backward: all-gather

Design (of the two Megatron-style options): every TP rank gathers the sequence over the TP group
and routes all of it, so inside the layer every TP rank holds the same tokens, exactly as without
sequence parallelism. That layout (router replicated, fc1 column- and fc2 row-parallel in the
experts, the dispatch over the EP group) is already the single process's computation; routing,
the capacity plan by global token order (megazero/moe/capacity.py), the auxiliary losses and the
statistics are unchanged, so SP is exact by construction. Megatron core instead routes each TP
rank's own shard and all-gathers the routed tokens inside the expert-TP group; it saves the TP-fold
router compute (a [tokens, E] matmul, small next to the experts) but the capacity plan would then
have to be rebuilt over the TP ranks' concatenated order to drop the tokens the single process
drops, which is a second planner for no gain on CPU/gloo.

Gradients: inside the layer the gradient of the whole-sequence input is the same on every TP rank
(the experts' input gradient is all-reduced over TP, megazero/moe/experts.py; the router is
replicated), so `gather_sequence`'s backward keeps this rank's slice of it; a reduce-scatter would
count it TP times. `split_sequence`'s backward all-gathers the ranks' slices into that whole,
same-on-every-rank gradient. Both are the identity when the group has one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.moe.comm import group_rank, group_size

SEQUENCE_DIM = 1  # [batch, seq, hidden], as megazero/tensor_parallel/mappings.py


def _slice(x: torch.Tensor, group) -> torch.Tensor:
    # x is a gathered whole (or its gradient): its sequence is TP equal slices
    return x.chunk(group_size(group), dim=SEQUENCE_DIM)[group_rank(group)].contiguous()


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=SEQUENCE_DIM)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _slice(grad, ctx.group), None


class _SplitSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence from every TP rank's slice of x [b, s/TP, ...]; the (same on every rank)
    gradient is cut back to this rank's slice."""
    if x.dim() < 2:
        raise ValueError(f"sequence-parallel MoE: input of shape {tuple(x.shape)} has no sequence dimension "
                         f"{SEQUENCE_DIM}")
    return _GatherSequence.apply(x, group) if group_size(group) > 1 else x


def split_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """This TP rank's slice of the sequence of x [b, s, ...]; the gradient is all-gathered."""
    return _SplitSequence.apply(x, group) if group_size(group) > 1 else x
