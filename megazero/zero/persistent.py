"""Re-gathering ZeRO-3's persistent parameters (those under `stage3_param_persistence_threshold`)
after an optimizer step, in as few collectives as possible.

Every unit has its own persistent shard (its biases and norms), so gathering them shard by shard
would cost one all-gather per unit (dozens per step on a small GPT, each latency-bound). Instead,
the shards of one dtype are packed into groups of up to `bucket_numel` gathered elements
(reduce_bucket_size); per group, every rank's partitions of its shards are laid side by side as
that rank's chunk of one buffer, gathered in one call, and copied out into each shard's full
parameter buffer. The result is the same bytes the per-shard gathers give.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.zero.collectives import all_gather_chunks


def _packs(shards: list, bucket_numel: int) -> list[list]:
    """Consecutive shards of one (dtype, device), each pack up to `bucket_numel` full elements
    (a larger shard is a pack of its own)."""
    packs: list[list] = []
    by_kind: dict[tuple, list] = {}
    for s in shards:
        by_kind.setdefault((s.dtype, s.device), []).append(s)
    for kind_shards in by_kind.values():
        current, filled = [], 0
        for s in kind_shards:
            if current and filled + s.layout.numel > bucket_numel:
                packs.append(current)
                current, filled = [], 0
            current.append(s)
            filled += s.layout.numel
        if current:
            packs.append(current)
    return packs


def gather_persistent(shards: list, group, bucket_numel: int) -> int:
    """Make every shard in `shards` (persistent `_Shard`s of `group`) whole from its partitions on
    all ranks; returns the number of all-gathers started."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    pending = []
    for pack in _packs(shards, bucket_numel):
        width = sum(s.layout.partition_numel for s in pack)
        buffer = torch.empty(world * width, dtype=pack[0].dtype, device=pack[0].device)
        chunks = buffer.view(world, width)
        offset = 0
        for s in pack:  # this rank's partitions, side by side
            chunks[rank, offset:offset + s.layout.partition_numel].copy_(s.shard)
            offset += s.layout.partition_numel
        pending.append((all_gather_chunks(buffer, group, "persistent parameters"), pack, chunks))
    for handle, pack, chunks in pending:
        handle.wait()
        offset = 0
        for s in pack:
            full = torch.empty(s.layout.numel, dtype=s.dtype, device=s.device)
            for r in range(world):
                for b, own in zip(s.layout.own_chunks(full, r),
                                  s.layout.split_partition(chunks[r, offset:offset + s.layout.partition_numel])):
                    b.copy_(own)
            s.point_params(full)
            offset += s.layout.partition_numel
    return len(pending)
