"""Where every parameter lives in a flat buffer, how the buffer is cut into buckets, and which slice
of each bucket each data-parallel rank owns.

Parameters are laid out in reverse registration order (backward produces their gradients roughly
in that order) and cut into buckets of about `bucket_numel` elements; a parameter never straddles
two buckets. For N ranks each bucket is padded to a multiple of N and split into N equal chunks:
rank r owns chunk r of every bucket. A rank's partition is the concatenation of its chunks, so a
bucket's reduce-scatter (or all-gather) moves exactly one chunk per rank, and the partitions of
all ranks are equal in size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    """A range [start, start + numel) of the flat buffer; numel is a multiple of the world size."""

    index: int
    start: int
    numel: int
    params: list[torch.nn.Parameter] = field(default_factory=list)
    partition_offset: int = 0  # where this bucket's chunk starts inside every rank's partition

    def chunk(self, world_size: int) -> int:
        """Elements each rank owns in this bucket."""
        return self.numel // world_size


@dataclass
class Fragment:
    """The part of one parameter that falls into one rank's partition."""

    param: torch.nn.Parameter
    param_start: int  # offset into param.view(-1)
    numel: int
    partition_start: int  # offset into the rank's partition


class FlatLayout:
    """The flat layout of `params` for `world_size` ranks (see the module docstring)."""

    def __init__(self, params: list[torch.nn.Parameter], bucket_numel: int, world_size: int):
        self.params = list(params)
        self.world_size = world_size
        self.offsets: dict[torch.nn.Parameter, int] = {}
        # recorded now: under ZeRO-3 a parameter's data may later be released to an empty tensor
        self.shapes: dict[torch.nn.Parameter, torch.Size] = {p: p.shape for p in self.params}
        self.numels: dict[torch.nn.Parameter, int] = {p: p.numel() for p in self.params}
        self.bucket_of: dict[torch.nn.Parameter, Bucket] = {}
        self.buckets: list[Bucket] = []
        start, filled, current = 0, 0, []
        for p in reversed(self.params):
            self.offsets[p] = start + filled
            filled += p.numel()
            current.append(p)
            if filled >= bucket_numel:
                self._close_bucket(start, filled, current)
                start, filled, current = start + self.buckets[-1].numel, 0, []
        if current:
            self._close_bucket(start, filled, current)
        self.numel = start + (self.buckets[-1].numel if current else 0)
        self.partition_numel = sum(b.chunk(world_size) for b in self.buckets)

    def _close_bucket(self, start: int, filled: int, params: list) -> None:
        padded = -(-filled // self.world_size) * self.world_size
        offset = sum(b.chunk(self.world_size) for b in self.buckets)
        bucket = Bucket(len(self.buckets), start, padded, list(params), offset)
        self.buckets.append(bucket)
        for p in params:
            self.bucket_of[p] = bucket

    @property
    def unpadded_numel(self) -> int:
        """Elements of the parameters themselves (no padding)."""
        return sum(self.numels.values())

    def rank_range(self, bucket: Bucket, rank: int) -> tuple[int, int]:
        """Flat-buffer range of `rank`'s chunk of `bucket`."""
        chunk = bucket.chunk(self.world_size)
        return bucket.start + rank * chunk, bucket.start + (rank + 1) * chunk

    def split_partition(self, partition: torch.Tensor) -> list[torch.Tensor]:
        """Views of a partition-sized tensor, one per bucket (that bucket's chunk)."""
        return [partition[b.partition_offset:b.partition_offset + b.chunk(self.world_size)] for b in self.buckets]

    def own_chunks(self, flat: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Views of a layout-sized tensor: `rank`'s chunk of every bucket."""
        return [flat[slice(*self.rank_range(b, rank))] for b in self.buckets]

    def fragments(self, rank: int) -> list[Fragment]:
        """Every piece of a parameter that lies in `rank`'s partition."""
        out = []
        for bucket in self.buckets:
            lo, hi = self.rank_range(bucket, rank)
            for p in bucket.params:
                begin, end = max(lo, self.offsets[p]), min(hi, self.offsets[p] + self.numels[p])
                if begin < end:
                    out.append(Fragment(p, begin - self.offsets[p], end - begin, bucket.partition_offset + begin - lo))
        return out
