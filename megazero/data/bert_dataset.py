"""BERT pretraining samples from a sentence-level indexed dataset (sequences = sentences, grouped
into documents by the index's document indices).

Samples are built once, deterministically: each document's sentences are taken in order and
grouped greedily into chunks of up to seq_length - 3 tokens (at least two sentences each). Sample
i is chunk order[i] (shuffled per epoch by seed): its sentences split at a point drawn from
(seed, i) into segment A and segment B; for sentence-order prediction B and A are swapped with
probability 1/2 (label 1 = swapped); for next-sentence prediction B is replaced with probability
1/2 by a chunk drawn uniformly from the chunks of the other documents (label 1 = random; never
from A's own document, so a "random" B is never A's true continuation or a passage of the same
text; NSP therefore needs chunks from at least two documents). Then [CLS] A [SEP] B [SEP], the longer
segment trimmed from its end to fit; 15% of the non-special tokens are selected for the
masked-LM loss and replaced by [MASK] (80%), a random token (10%) or kept (10%); padding with
[PAD] to seq_length.
"""

from __future__ import annotations

import numpy as np
import torch

from megazero.data.indexed_dataset import IndexedDataset
from megazero.data.loader import MultiEpochDataset
from megazero.data.vocab_check import check_token_ids


class BertDataset(MultiEpochDataset):
    """Items: input_ids, token_type_ids, padding_mask (bool), labels, loss_mask (float32),
    sentence_order (0/1), all of length seq_length except the last."""

    def __init__(self, indexed: IndexedDataset, seq_length: int, special: dict[str, int], vocab_size: int,
                 seed: int = 1234, masked_lm_prob: float = 0.15, binary_head: str = "sop", shuffle: bool = True):
        missing = {"[CLS]", "[SEP]", "[MASK]", "[PAD]"} - set(special)
        if missing:
            raise ValueError(f"special token ids missing: {sorted(missing)}")
        self.indexed, self.seq_length, self.special, self.vocab_size = indexed, seq_length, special, vocab_size
        self.seed, self.masked_lm_prob, self.binary_head, self.shuffle = seed, masked_lm_prob, binary_head, shuffle
        if binary_head not in ("sop", "nsp"):
            raise ValueError(f"binary_head must be 'sop' or 'nsp', got {binary_head!r}")
        check_token_ids(indexed, vocab_size)  # ids past the tokenizer's vocab: another tokenizer's data
        self.chunks, self.chunk_documents = self._build_chunks()
        if not self.chunks:
            raise ValueError(f"{indexed.prefix}: no document has two sentences that fit in seq_length {seq_length}")
        documents = np.unique(self.chunk_documents)
        if binary_head == "nsp" and len(documents) < 2:
            raise ValueError(f"{indexed.prefix}: next-sentence prediction draws the random B from another document, "
                             f"but only document {int(documents[0])} has chunks (two sentences within seq_length "
                             f"{seq_length}); use binary_head='sop' or a corpus of several documents")
        # a document's chunks are contiguous: [first chunk, end chunk) of each chunk's document
        starts = np.searchsorted(self.chunk_documents, self.chunk_documents, side="left")
        ends = np.searchsorted(self.chunk_documents, self.chunk_documents, side="right")
        self._document_chunks = np.stack([starts, ends], axis=1)
        self._orders: dict[int, np.ndarray] = {}

    def _build_chunks(self) -> tuple[list[tuple[int, int]], np.ndarray]:
        """(first sentence, end sentence) of every chunk: whole sentences, up to seq_length - 3 tokens;
        and each chunk's document (ascending: chunks are made document by document)."""
        budget = self.seq_length - 3
        docs, sizes = self.indexed.document_indices, self.indexed.sizes
        chunks, documents = [], []
        for d in range(len(docs) - 1):
            start, total = int(docs[d]), 0
            for s in range(int(docs[d]), int(docs[d + 1])):
                if total and total + sizes[s] > budget:
                    if s - start >= 2:
                        chunks.append((start, s))
                        documents.append(d)
                    start, total = s, 0
                total += int(sizes[s])
            if int(docs[d + 1]) - start >= 2:
                chunks.append((start, int(docs[d + 1])))
                documents.append(d)
        return chunks, np.array(documents, dtype=np.int64)

    def __len__(self) -> int:
        """Samples in one epoch."""
        return len(self.chunks)

    def _chunk_index(self, index: int) -> int:
        epoch, position = divmod(index, len(self.chunks))
        if not self.shuffle:
            return position
        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.clear()
            self._orders[epoch] = np.random.default_rng(self.seed + epoch).permutation(len(self.chunks))
        return int(self._orders[epoch][position])

    def _other_document_chunk(self, chunk: int, rng: np.random.Generator) -> int:
        """A chunk drawn uniformly from those of every document but `chunk`'s."""
        first, end = (int(x) for x in self._document_chunks[chunk])
        drawn = int(rng.integers(len(self.chunks) - (end - first)))
        return drawn if drawn < first else drawn + (end - first)  # skip over the own document's chunks

    def _sentences(self, first: int, end: int) -> list[int]:
        return [int(t) for s in range(first, end) for t in self.indexed[s]]

    def _segments(self, index: int, rng: np.random.Generator) -> tuple[list[int], list[int], int]:
        chunk = self._chunk_index(index)
        first, end = self.chunks[chunk]
        split = int(rng.integers(first + 1, end))
        a, b = self._sentences(first, split), self._sentences(split, end)
        if self.binary_head == "sop":
            return (b, a, 1) if rng.random() < 0.5 else (a, b, 0)
        if rng.random() < 0.5:  # nsp: B from another document
            other_first, other_end = self.chunks[self._other_document_chunk(chunk, rng)]
            return a, self._sentences(other_first, other_end), 1
        return a, b, 0

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.seed, index])
        a, b, label = self._segments(index, rng)
        while len(a) + len(b) > self.seq_length - 3:  # trim the longer segment from its end
            (a if len(a) >= len(b) else b).pop()
        cls, sep, mask, pad = (self.special[k] for k in ("[CLS]", "[SEP]", "[MASK]", "[PAD]"))
        tokens = np.array([cls, *a, sep, *b, sep], dtype=np.int64)
        types = np.array([0] * (len(a) + 2) + [1] * (len(b) + 1), dtype=np.int64)
        labels = np.zeros(self.seq_length, dtype=np.int64)
        loss_mask = np.zeros(self.seq_length, dtype=np.float32)
        candidates = np.array([i for i, t in enumerate(tokens) if t not in (cls, sep)])
        count = max(1, int(round(self.masked_lm_prob * len(candidates))))
        specials = set(self.special.values())
        for i in rng.choice(candidates, size=count, replace=False):
            labels[i], loss_mask[i] = tokens[i], 1.0
            roll = rng.random()
            if roll < 0.8:
                tokens[i] = mask
            elif roll < 0.9:  # a random ordinary token
                replacement = int(rng.integers(self.vocab_size))
                while replacement in specials:
                    replacement = int(rng.integers(self.vocab_size))
                tokens[i] = replacement
        length = len(tokens)
        input_ids = np.full(self.seq_length, pad, dtype=np.int64)
        input_ids[:length] = tokens
        token_types = np.zeros(self.seq_length, dtype=np.int64)
        token_types[:length] = types
        padding = np.zeros(self.seq_length, dtype=bool)
        padding[:length] = True
        return {"input_ids": torch.from_numpy(input_ids), "token_type_ids": torch.from_numpy(token_types),
                "padding_mask": torch.from_numpy(padding), "labels": torch.from_numpy(labels),
                "loss_mask": torch.from_numpy(loss_mask), "sentence_order": torch.tensor(label)}
