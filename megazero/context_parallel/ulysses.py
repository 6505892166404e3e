"""All-to-all attention (DeepSpeed-Ulysses): each context-parallel rank holds its tokens of every
head; one all-to-all gives each rank every token of heads / CP heads, attention runs there over the
whole sequence, and a second all-to-all brings the output back to the tokens' rank.

q is [batch, heads, tokens here, d] and k, v [batch, key/value heads, tokens here, d], the tokens in
megazero.context_parallel.split's load-balanced order. heads must be divisible by CP; key/value
heads that are not (grouped-query attention with fewer groups than CP) are repeated to one per query
head first, so that each rank gets the key/value heads its query heads use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megazero.context_parallel.comm import all_to_all
from megazero.context_parallel.split import load_balanced_positions


def _global_order(seq_local: int, cp_size: int, device) -> torch.Tensor:
    """The global position of each token of the rank-by-rank concatenation of the ranks' tokens."""
    return torch.cat([load_balanced_positions(seq_local * cp_size, cp_size, r, device) for r in range(cp_size)])


def _to_heads(x: torch.Tensor, group, cp_size: int, order: torch.Tensor) -> torch.Tensor:
    """[b, h, s/cp, d] with this rank's tokens -> [b, h/cp, s, d] with every token of its heads."""
    b, h, s, d = x.shape
    parts = x.reshape(b, cp_size, h // cp_size, s, d).transpose(0, 1)  # part i: head group i, to rank i
    received = all_to_all(parts, group)  # [cp (source rank), b, h/cp, s/cp, d]
    whole = received.permute(1, 2, 0, 3, 4).reshape(b, h // cp_size, cp_size * s, d)  # ranks' tokens in rank order
    return whole.index_select(2, torch.argsort(order))


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                      attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """attend(q, k, v) over the whole sequence for this rank's share of the heads; the output for
    this rank's tokens of every head ([batch, heads, tokens here, d])."""
    cp_size = dist.get_world_size(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % cp_size:
        raise ValueError(f"all-to-all context parallelism splits the heads: num_attention_heads per tensor-parallel "
                         f"rank ({heads}) must be divisible by context_parallel_size ({cp_size})")
    if kv_heads % cp_size:
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    order = _global_order(q.shape[2], cp_size, q.device)
    out = attend(*(_to_heads(t, group, cp_size, order) for t in (q, k, v)))  # [b, h/cp, s, d] in global order
    b, h_part, s, d = out.shape
    local = s // cp_size
    by_rank = out.index_select(2, order).reshape(b, h_part, cp_size, local, d).permute(2, 0, 1, 3, 4)
    back = all_to_all(by_rank, group)  # [cp (head group), b, h/cp, s/cp, d]
    return back.transpose(0, 1).reshape(b, h_part * cp_size, local, d)
