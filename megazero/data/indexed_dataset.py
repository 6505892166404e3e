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


def _write_index(path: str, dtype: np.dtype, sizes: np.ndarray, document_indices: np.ndarray) -> None:
    """The MMIDIDX header, sizes, pointers (from the sizes) and document index, to `path`."""
    sizes = np.asarray(sizes, dtype=np.int32)
    doc_idx = np.asarray(document_indices, dtype=np.int64)
    if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != len(sizes) or np.any(np.diff(doc_idx) < 0):
        raise ValueError(f"document_indices must rise from 0 to {len(sizes)}")
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        pointers[1:] = np.cumsum(sizes[:-1].astype(np.int64)) * dtype.itemsize
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", _CODE_OF[dtype]))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_idx.tobytes())


class IndexedDatasetWriter:
    """Streams prefix.bin as sequences arrive and writes prefix.idx from the sizes collected in order
    (4 bytes per sequence and 8 per document in memory, never the tokens); both files appear only
    at finalize() (temporary names, then rename), so a crash leaves no half-written dataset."""

    def __init__(self, prefix: str, dtype: np.dtype):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
        self._bin = open(prefix + ".bin.tmp", "wb")
        self._sizes: list[np.ndarray] = []
        self._docs: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self.sequences = 0

    def add(self, tokens: np.ndarray, sizes: np.ndarray, document_ends: np.ndarray | None = None) -> None:
        """Append sequences: `tokens` back to back, `sizes` their lengths, `document_ends` (relative
        to these sequences: the sequence count at the end of each document; default every sequence
        a document)."""
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        sizes = np.asarray(sizes, dtype=np.int32)
        if int(sizes.sum(dtype=np.int64)) != len(tokens):
            raise ValueError(f"{self.prefix}: sizes sum to {int(sizes.sum())}, but {len(tokens)} tokens were given")
        ends = np.arange(1, len(sizes) + 1) if document_ends is None else np.asarray(document_ends)
        self._bin.write(tokens.tobytes())
        self._sizes.append(sizes)
        self._docs.append(ends.astype(np.int64) + self.sequences)
        self.sequences += len(sizes)

    def append_dataset(self, part: IndexedDataset, copy_bytes: int = 64 << 20) -> None:
        """Append every sequence and document of `part` (its .bin copied in `copy_bytes` pieces)."""
        with open(part.prefix + ".bin", "rb") as f:
            while piece := f.read(copy_bytes):
                self._bin.write(piece)
        self._sizes.append(np.array(part.sizes))
        self._docs.append(part.document_indices[1:] + self.sequences)
        self.sequences += len(part.sizes)

    def abort(self) -> None:
        """Remove the temporary .bin (after an error: nothing is left half-written)."""
        self._bin.close()
        if os.path.exists(self.prefix + ".bin.tmp"):
            os.remove(self.prefix + ".bin.tmp")

    def finalize(self) -> None:
        """Write the .idx and move both files into place."""
        self._bin.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, np.int32)
        _write_index(self.prefix + ".idx.tmp", self.dtype, sizes, np.concatenate(self._docs))
        os.replace(self.prefix + ".bin.tmp", self.prefix + ".bin")
        os.replace(self.prefix + ".idx.tmp", self.prefix + ".idx")


def write_indexed_dataset(prefix: str, documents: list[list[int]] | list[np.ndarray], dtype: np.dtype,
                          document_indices: list[int] | None = None) -> None:
    """Write prefix.bin and prefix.idx atomically (temporary names, then rename).

    Each entry of `documents` is one sequence. `document_indices` (Megatron's doc_idx: 0, the
    index of each document's first sequence, ..., len(documents)) groups sequences into
    documents, e.g. a document's sentences for BERT; by default every sequence is a document.
    """
    dtype = np.dtype(dtype)
    doc_idx = np.arange(len(documents) + 1, dtype=np.int64) if document_indices is None \
        else np.asarray(document_indices, dtype=np.int64)
    if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != len(documents) or np.any(np.diff(doc_idx) < 0):
        raise ValueError(f"document_indices must rise from 0 to {len(documents)}")
    writer = IndexedDatasetWriter(prefix, dtype)
    arrays = [np.asarray(d, dtype=dtype) for d in documents]
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype)
    writer.add(tokens, np.array([len(a) for a in arrays], dtype=np.int32), doc_idx[1:])
    writer.finalize()


def merge_indexed_datasets(prefixes: list[str], output_prefix: str, copy_bytes: int = 64 << 20) -> None:
    """Join datasets (same dtype) into one, in the given order: the .bin files back to back (copied
    in `copy_bytes` pieces), the sizes and document indices concatenated. The result is byte for
    byte the dataset one writer would have made from the same sequences."""
    parts = [IndexedDataset(p) for p in prefixes]
    if not parts:
        raise ValueError("merge_indexed_datasets: no datasets given")
    for part in parts[1:]:
        if part.dtype != parts[0].dtype:
            raise DatasetFormatError(f"{part.prefix}: dtype {part.dtype.name}, expected {parts[0].dtype.name} "
                                     f"(that of {parts[0].prefix}): datasets from different tokenizers?")
    writer = IndexedDatasetWriter(output_prefix, parts[0].dtype)
    for part in parts:
        writer.append_dataset(part, copy_bytes)
    writer.finalize()


class _Sequences:
    """Sequences read through `sizes`, `pointers` (bytes) and `tokens` (the mapped .bin, or a view of it)."""

    sizes: np.ndarray
    pointers: np.ndarray
    tokens: np.ndarray
    dtype: np.dtype

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        """Token ids of sequence i."""
        start = int(self.pointers[i]) // self.dtype.itemsize
        return np.asarray(self.tokens[start:start + int(self.sizes[i])])

    @property
    def num_tokens(self) -> int:
        """All tokens of these sequences."""
        return int(self.sizes.sum())


class IndexedDataset(_Sequences):
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



class DocumentRange(_Sequences):
    """Documents [first, end) of an IndexedDataset read as a dataset of their own (the same
    attributes, `tokens` a view of the mapped .bin): a train, valid or test part of Megatron's
    --split by documents."""

    def __init__(self, indexed: IndexedDataset, first: int, end: int):
        if not 0 <= first <= end < len(indexed.document_indices):
            raise ValueError(f"{indexed.prefix}: documents [{first}, {end}) are outside the "
                             f"{len(indexed.document_indices) - 1} it has")
        self.prefix, self.dtype, self.first, self.end = indexed.prefix, indexed.dtype, first, end
        seq0, seq1 = int(indexed.document_indices[first]), int(indexed.document_indices[end])
        self.sizes = indexed.sizes[seq0:seq1]
        base = int(indexed.pointers[seq0]) if seq1 > seq0 else 0
        self.pointers = indexed.pointers[seq0:seq1] - base
        self.document_indices = indexed.document_indices[first:end + 1] - seq0
        start = base // self.dtype.itemsize
        self.tokens = indexed.tokens[start:start + int(self.sizes.sum())]


def split_documents(split: str, documents: int) -> list[tuple[int, int]]:
    """[first, end) of the train, valid and test documents for a Megatron --split such as
    "969,30,1" (weights, normalised; rounded as Megatron does, the last part absorbing the rest)."""
    try:
        parts = [float(s) for s in split.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to 3 comma-separated numbers, e.g. 969,30,1") from None
    parts = (parts + [0.0, 0.0])[:3]
    if len(split.split(",")) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {split!r}: expected up to 3 non-negative numbers with a positive sum")
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + int(round(p / sum(parts) * documents)))
    diff = bounds[-1] - documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]
