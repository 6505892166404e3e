"""A data-parallel loader that resumes at an exact sample."""

from __future__ import annotations

from collections.abc import Iterator

import torch


class MultiEpochDataset:
    """Base class of datasets whose index i >= len(self) reads epoch i // len(self) (reshuffled),
    so a loader can run through as many epochs as training needs without restarting (GPTDataset,
    BertDataset). The engine's loader iterates such a dataset without end; any other map-style
    dataset gets one pass per `iter()`, as torch's and DeepSpeed's loaders do."""


def collate(samples: list) -> object:
    """Batch samples as torch's DataLoader does (its default_collate): {name: tensor} samples stack per
    name; (input, label) samples, as torchvision's datasets give them, become [inputs, labels]."""
    return torch.utils.data.default_collate(samples)


class DistributedBatchLoader:
    """Yields this rank's micro-batches: in each run of micro_batch_size * dp_size consecutive
    sample indices, rank r takes the r-th slice of micro_batch_size, so ranks never overlap and
    together read every sample once.

    `consumed_samples` (global, over all ranks) is where iteration starts; it advances as batches
    are yielded and can be set to resume. `num_samples` bounds iteration. Without it, a
    MultiEpochDataset is read without end, and any other dataset one pass per `iter()`
    (`len(self)` micro-batches; a pass ends where an uninterrupted run's would, also after a
    resume), the sample stream wrapping around the dataset, so that `for batch in loader` is one
    epoch, as in DeepSpeed's tutorial loop.
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

    def _end_of_iteration(self) -> int | None:
        """The consumed-samples count at which the iterator started now stops (None: never)."""
        if self.num_samples is not None:
            return self.num_samples
        if isinstance(self.dataset, MultiEpochDataset):
            return None
        per_pass = len(self) * self.global_micro_batch
        if per_pass == 0:
            raise ValueError(f"the dataset has {len(self.dataset)} samples, fewer than one global micro-batch "
                             f"({self.micro_batch_size} per rank x {self.dp_size} ranks)")
        return (self.consumed_samples // per_pass + 1) * per_pass

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        end = self._end_of_iteration()
        wrap = None if isinstance(self.dataset, MultiEpochDataset) else len(self.dataset)
        while end is None or self.consumed_samples + self.global_micro_batch <= end:
            indices = self.indices(self.consumed_samples)
            batch = collate([self.dataset[i % wrap if wrap else i] for i in indices])
            self.consumed_samples += self.global_micro_batch
            yield batch
