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
        expected = int(self.sizes.sum()) * self.dtype.itemsize
        actual = os.path.getsize(bin_path)
        if actual != expected:
            raise DatasetFormatError(f"{bin_path}: {actual} bytes, but {idx_path} describes {expected} "
                                     f"({int(self.sizes.sum())} tokens of {self.dtype.name}); truncated or mismatched")
        self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r") if expected else np.zeros(0, self.dtype)

    def _read_index(self, path: str) -> None:
        with open(path, "rb") as f:
            data = f.read()
        header = len(MAGIC) + 8 + 1 + 8 + 8
        if len(data) < header or data[:len(MAGIC)] != MAGIC:
            raise DatasetFormatError(f"{path}: not an MMIDIDX index (bad magic or too short)")
        version, code, count, doc_count = struct.unpack_from("<QBQQ", data, len(MAGIC))
        if version != VERSION:
            raise DatasetFormatError(f"{path}: version {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            raise DatasetFormatError(f"{path}: unknown dtype code {code}")
        need = header + count * 4 + count * 8 + doc_count * 8
        if len(data) != need:
            raise DatasetFormatError(f"{path}: {len(data)} bytes, expected {need} for {count} sequences; "
                                     f"truncated or corrupt")
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.sizes = np.frombuffer(data, np.int32, count, header)
        self.pointers = np.frombuffer(data, np.int64, count, header + count * 4)
        self.document_indices = np.frombuffer(data, np.int64, doc_count, header + count * 12)

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
