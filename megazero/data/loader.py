"""A data-parallel loader that resumes at an exact sample."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a list of {name: tensor} samples into one batch."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


class DistributedBatchLoader:
    """Yields this rank's micro-batches: in each run of micro_batch_size * dp_size consecutive
    sample indices, rank r takes the r-th slice of micro_batch_size, so ranks never overlap and
    together read every sample once.

    `consumed_samples` (global, over all ranks) is where iteration starts; it advances as batches
    are yielded and can be set to resume. `num_samples` bounds iteration (None: run forever,
    which suits datasets that continue into later epochs).
    """

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 consumed_samples: int = 0, num_samples: int | None = None):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = consumed_samples
        self.num_samples = num_samples

    @property
    def global_micro_batch(self) -> int:
        """Samples consumed by all ranks together per micro-step."""
        return self.micro_batch_size * self.dp_size

    def __len__(self) -> int:
        """Micro-batches per rank in one pass over the dataset (or over num_samples)."""
        total = self.num_samples if self.num_samples is not None else len(self.dataset)
        return total // self.global_micro_batch

    def set_consumed_samples(self, consumed_samples: int) -> None:
        """Resume: the next iterator starts at this global sample index."""
        self.consumed_samples = consumed_samples

    def indices(self, start: int) -> list[int]:
        """This rank's sample indices in the global micro-batch that starts at `start`."""
        first = start + self.dp_rank * self.micro_batch_size
        return list(range(first, first + self.micro_batch_size))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while self.num_samples is None or self.consumed_samples + self.global_micro_batch <= self.num_samples:
            batch = collate([self.dataset[i] for i in self.indices(self.consumed_samples)])
            self.consumed_samples += self.global_micro_batch
            yield batch
