"""Which tokens of a sample each context-parallel rank holds.

The sequence is cut into 2 x CP chunks and rank r holds chunks r and 2 x CP - 1 - r (Megatron-Core's
causal load balancing): under a causal mask chunk c attends to c + 1 chunks, so every rank gets the
same attention work (r + 1 + 2 x CP - r = 2 x CP + 1 chunk pairs). Positions (for position
embeddings and RoPE) are the tokens' global ones, `load_balanced_positions`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks of 2 x cp_size that rank cp_rank holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def load_balanced_positions(seq_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global positions of the tokens rank cp_rank holds, in its order ([seq_length / cp_size])."""
    if seq_length % (2 * cp_size):
        raise ValueError(f"seq_length {seq_length} must be divisible by 2 x context_parallel_size = {2 * cp_size}")
    chunk = seq_length // (2 * cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunk_ids(cp_size, cp_rank)])


def split_sequence(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of x (the whole sequence along `dim`), in load_balanced_positions' order."""
    positions = load_balanced_positions(x.shape[dim], cp_size, cp_rank, x.device)
    return x.index_select(dim, positions)


def gather_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's split_sequence part (no gradient: for checks and
    generation), in global order."""
    cp_size = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(cp_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    seq = x.shape[dim] * cp_size
    order = torch.cat([load_balanced_positions(seq, cp_size, r, x.device) for r in range(cp_size)])
    whole = torch.cat(parts, dim=dim)
    return whole.index_select(dim, torch.argsort(order))
