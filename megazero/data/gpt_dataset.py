"""GPT training samples: windows of seq_length + 1 tokens over the token stream, shuffled per epoch."""

from __future__ import annotations

import numpy as np
import torch

from megazero.data.indexed_dataset import IndexedDataset
from megazero.data.loader import MultiEpochDataset
from megazero.data.packing import DocumentPacking
from megazero.data.vocab_check import check_token_ids


class GPTDataset(MultiEpochDataset):
    """Sample i is tokens [s*T, s*T + T + 1) for a window s, across document boundaries.

    Windows share one token with the next (the last label is the next window's first input), as
    in Megatron. With `shuffle`, epoch e visits the windows in a permutation drawn from seed + e,
    and any index >= len() continues into later epochs, so a loader can run for as many samples
    as training needs. Items are {"input_ids": int64[T], "labels": int64[T]}, and with `packing`
    the fields its flags add (megazero/data/packing.py: position_ids, document_ids, loss_mask).
    With `vocab_size` (the tokenizer's), every token id is checked to be below it first (one pass
    over the .bin).
    """

    def __init__(self, indexed: IndexedDataset, seq_length: int, seed: int = 1234, shuffle: bool = True,
                 vocab_size: int | None = None, packing: DocumentPacking | None = None):
        if indexed.num_tokens < seq_length + 1:
            raise ValueError(f"{indexed.prefix}: {indexed.num_tokens} tokens, fewer than one sample of "
                             f"seq_length {seq_length} + 1")
        if vocab_size is not None:
            check_token_ids(indexed, vocab_size)
        self.indexed = indexed
        self.seq_length = seq_length
        self.seed = seed
        self.shuffle = shuffle
        self.packing = packing if packing is not None and packing.enabled else None
        self.windows = (indexed.num_tokens - 1) // seq_length
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        """Samples in one epoch."""
        return self.windows

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.clear()
            self._orders[epoch] = np.random.default_rng(self.seed + epoch).permutation(self.windows)
        return self._orders[epoch]

    def window_of(self, index: int) -> int:
        """Which window sample `index` reads."""
        epoch, position = divmod(index, self.windows)
        if not self.shuffle:
            return position
        return int(self._order(epoch)[position])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = self.window_of(index) * self.seq_length
        chunk = torch.from_numpy(self.indexed.tokens[start:start + self.seq_length + 1].astype(np.int64))
        sample = {"input_ids": chunk[:-1], "labels": chunk[1:]}
        if self.packing is not None:
            sample.update(self.packing.fields(sample["input_ids"]))
        return sample
