"""Indexed, memory-mapped token datasets: a .bin of token ids and an .idx describing it.

The .idx layout is Megatron's MMIDIDX (little-endian), so Megatron can read these files too:
    magic           9 bytes  b"MMIDIDX\\x00\\x00"
    version         uint64   1
    dtype code      uint8    1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count  uint64   S
    document count  uint64   D + 1
    sizes           int32[S]      tokens in each sequence
    pointers        int64[S]      byte offset of each sequence in the .bin
    document index  int64[D + 1]  sequence index where each document starts (last = S)
Here a sequence is a whole document (ending with the end-of-document token), so the document
index is 0..S. The .bin is the sequences' token ids back to back.
"""

from __future__ import annotations

import os
import struct

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class DatasetFormatError(ValueError):
    """An .idx/.bin pair is truncated, mismatched or not in this format."""


def _dtype_hint(actual: int, tokens: int, dtype: np.dtype) -> str:
    """When the .bin's size is that of the same tokens in another dtype, say so: the .idx's dtype
    code is then the likely culprit, not a truncation."""
    fits = [np.dtype(d).name for d in DTYPE_CODES.values()
            if np.dtype(d) != dtype and tokens * np.dtype(d).itemsize == actual]
    return f" (that is the size of {tokens} tokens of {' or '.join(fits)}: a wrong dtype code?)" if fits else ""


def best_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def write_indexed_dataset(prefix: str, documents: list[list[int]] | list[np.ndarray], dtype: np.dtype,
                          document_indices: list[int] | None = None) -> None:
    """Write prefix.bin and prefix.idx atomically (temporary names, then rename).

    Each entry of `documents` is one sequence. `document_indices` (Megatron's doc_idx: 0, the
    index of each document's first sequence, ..., len(documents)) groups sequences into
    documents, e.g. a document's sentences for BERT; by default every sequence is a document.
    """
    dtype = np.dtype(dtype)
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    sizes = np.array([len(d) for d in documents], dtype=np.int32)
    pointers = np.zeros(len(documents), dtype=np.int64)
    if len(documents) > 1:
        pointers[1:] = np.cumsum(sizes[:-1].astype(np.int64)) * dtype.itemsize
    tmp_bin, tmp_idx = prefix + ".bin.tmp", prefix + ".idx.tmp"
    with open(tmp_bin, "wb") as f:
        for doc in documents:
            f.write(np.asarray(doc, dtype=dtype).tobytes())
    with open(tmp_idx, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", _CODE_OF[dtype]))
        f.write(struct.pack("<Q", len(documents)))
        doc_idx = np.arange(len(documents) + 1, dtype=np.int64) if document_indices is None \
            else np.asarray(document_indices, dtype=np.int64)
        if doc_idx[0] != 0 or doc_idx[-1] != len(documents) or np.any(np.diff(doc_idx) < 0):
            raise ValueError(f"document_indices must rise from 0 to {len(documents)}")
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_idx.tobytes())
    os.replace(tmp_bin, prefix + ".bin")
    os.replace(tmp_idx, prefix + ".idx")


class IndexedDataset:
    """Reads prefix.idx eagerly (small) and maps prefix.bin (never loaded whole)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file not found: {path}")
        self._read_index(idx_path)
        tokens = int(self.sizes.sum())
        expected = tokens * self.dtype.itemsize
        actual = os.path.getsize(bin_path)
        if actual != expected:
            raise DatasetFormatError(f"{bin_path}: {actual} bytes, but {idx_path} describes {expected} "
                                     f"({tokens} tokens of {self.dtype.name}); truncated or mismatched"
                                     f"{_dtype_hint(actual, tokens, self.dtype)}")
        self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r") if expected else np.zeros(0, self.dtype)

    def _read_index(self, path: str) -> None:
        with open(path, "rb") as f:
            data = f.read()
        header = len(MAGIC) + 8 + 1 + 8 + 8
        if data[:len(MAGIC)] != MAGIC:
            raise DatasetFormatError(f"{path}: not an MMIDIDX index (bad magic): starts with {data[:len(MAGIC)]!r}, "
                                     f"expected {MAGIC!r}")
        if len(data) < header:
            raise DatasetFormatError(f"{path}: not an MMIDIDX index (too short): {len(data)} bytes, expected at "
                                     f"least the {header}-byte header")
        version, code, count, doc_count = struct.unpack_from("<QBQQ", data, len(MAGIC))
        if version != VERSION:
            raise DatasetFormatError(f"{path}: version {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            known = ", ".join(f"{k} {np.dtype(v).name}" for k, v in DTYPE_CODES.items())
            raise DatasetFormatError(f"{path}: unknown dtype code {code}, expected one of {known}")
        need = header + count * 4 + count * 8 + doc_count * 8
        if len(data) != need:
            raise DatasetFormatError(f"{path}: {len(data)} bytes, expected {need} for {count} sequences; "
                                     f"truncated or corrupt")
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.sizes = np.frombuffer(data, np.int32, count, header)
        self.pointers = np.frombuffer(data, np.int64, count, header + count * 4)
        self.document_indices = np.frombuffer(data, np.int64, doc_count, header + count * 12)
        self._check_index(path)

    def _check_index(self, path: str) -> None:
        """The header's arrays must agree with one another (vectorised, O(sequences)): a corrupt
        size or pointer would otherwise read the wrong tokens without any error."""
        if len(self.sizes) and int(self.sizes.min()) < 0:
            i = int(np.argmin(self.sizes))
            raise DatasetFormatError(f"{path}: sequence {i} has size {int(self.sizes[i])}, expected >= 0; corrupt")
        starts = np.zeros(len(self.sizes), dtype=np.int64)  # in tokens
        np.cumsum(self.sizes[:-1], dtype=np.int64, out=starts[1:])
        wrong = np.flatnonzero(self.pointers != starts * self.dtype.itemsize)
        if len(wrong):
            i = int(wrong[0])
            fits = [np.dtype(d).name for d in DTYPE_CODES.values() if np.dtype(d) != self.dtype
                    and np.array_equal(self.pointers, starts * np.dtype(d).itemsize)]
            hint = f" (they are offsets of {' or '.join(fits)} tokens: a wrong dtype code?)" if fits else ""
            raise DatasetFormatError(f"{path}: sequence {i} starts at byte {int(self.pointers[i])}, expected "
                                     f"{int(starts[i]) * self.dtype.itemsize} (the sizes of the sequences before it, "
                                     f"in {self.dtype.name}); corrupt header{hint}")
        docs = self.document_indices
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(self.sizes) or np.any(np.diff(docs) < 0):
            found = f"{int(docs[0])} .. {int(docs[-1])}" if len(docs) else "nothing"
            raise DatasetFormatError(f"{path}: document index must rise from 0 to the sequence count "
                                     f"{len(self.sizes)}, found {found}; corrupt header")

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        """Token ids of sequence i."""
        start = int(self.pointers[i]) // self.dtype.itemsize
        return np.asarray(self.tokens[start:start + int(self.sizes[i])])

    @property
    def num_tokens(self) -> int:
        """All tokens in the .bin."""
        return int(self.sizes.sum())
