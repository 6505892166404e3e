"""Token ids against the tokenizer: data tokenized with another vocabulary fails before training.

An id >= the vocab size would index past the embedding (a crash on the GPU, or garbage from the
padded rows); a smaller vocabulary than the data's is the usual sign that the data was made with
another tokenizer. One vectorised pass over the memory-mapped .bin, in chunks that stay in cache
(min and max from the same read), finds the largest and smallest id.
"""

from __future__ import annotations

import numpy as np

from megazero.data.indexed_dataset import DatasetFormatError, IndexedDataset

CHUNK_TOKENS = 1 << 22  # 4M tokens (8 MB of uint16) per pass: two reductions from one read


def token_id_range(indexed: IndexedDataset, chunk_tokens: int = CHUNK_TOKENS) -> tuple[int, int]:
    """(smallest, largest) token id in the .bin; (0, -1) when it is empty."""
    tokens = indexed.tokens
    if len(tokens) == 0:
        return 0, -1
    signed = tokens.dtype.kind != "u"  # unsigned ids cannot be negative: skip the min
    low, high = 0, None
    for start in range(0, len(tokens), chunk_tokens):
        chunk = tokens[start:start + chunk_tokens]
        top = chunk.max()
        high = top if high is None or top > high else high
        if signed:
            low = min(low, chunk.min())
    return int(low), int(high)


def _first_position(indexed: IndexedDataset, predicate) -> tuple[int, int]:
    """(token offset, sequence) of the first token for which predicate(chunk) is true (error path)."""
    tokens = indexed.tokens
    for start in range(0, len(tokens), CHUNK_TOKENS):
        hits = np.flatnonzero(predicate(tokens[start:start + CHUNK_TOKENS]))
        if len(hits):
            offset = start + int(hits[0])
            first_token = np.asarray(indexed.pointers) // indexed.dtype.itemsize
            return offset, int(np.searchsorted(first_token, offset, side="right")) - 1
    return -1, -1


def check_token_ids(indexed: IndexedDataset, vocab_size: int, tokenizer: str | None = None) -> int:
    """Raise DatasetFormatError naming the .bin (and `tokenizer`, where vocab_size came from) unless
    every token id is in [0, vocab_size); returns the largest id."""
    low, high = token_id_range(indexed)
    source = f"the tokenizer {tokenizer}" if tokenizer else "the tokenizer"
    path = indexed.prefix + ".bin"
    if high >= vocab_size:
        offset, sequence = _first_position(indexed, lambda chunk: chunk >= vocab_size)
        raise DatasetFormatError(
            f"{path}: token id {high} found (first id >= {vocab_size}: {int(indexed.tokens[offset])} at token "
            f"{offset}, sequence {sequence}), but {source} has vocab size {vocab_size}: expected ids in "
            f"[0, {vocab_size}); the data was tokenized with another (larger) vocabulary")
    if low < 0:
        offset, sequence = _first_position(indexed, lambda chunk: chunk < 0)
        raise DatasetFormatError(f"{path}: negative token id {low} (first at token {offset}, sequence {sequence}); "
                                 f"expected ids in [0, {vocab_size}) of {source}")
    return high
