"""Preprocessing inputs: which files, how to open them (.gz, .zst) and the documents they hold.

A text file (.txt) is one document. A jsonl file (.jsonl, .jsonl.gz, .jsonl.zst) holds one document
per non-blank line, a JSON object whose `json_key` field is the text. A table (.parquet, or .arrow as
Hugging Face `datasets` writes it) holds one document per row, its `json_key` column the text; a
directory written by `datasets`' `save_to_disk` is its .arrow shards in order. Tables are read a
record batch at a time, never whole. Every non-blank line (every row) is one document slot, so that
the document numbering (and the train/valid split drawn over it) does not depend on which lines
turn out to be bad: a bad line skipped with `skip_bad_lines` is an empty slot, counted and
reported, never silently dropped.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
TEXT_SUFFIXES = (".txt",)
TABLE_SUFFIXES = (".parquet", ".arrow")
TABLE_BATCH_ROWS = 1024  # rows per record batch read from a parquet file


class BadLineError(ValueError):
    """A jsonl line that is not a JSON object with a string under the key (names file and line)."""


def input_files(inputs: list[str]) -> list[str]:
    """The files named, and those in the named directories (text, jsonl and tables, sorted; a
    `datasets` save_to_disk directory: its .arrow shards in its own order), in order."""
    paths = []
    for item in inputs:
        if os.path.isdir(item):
            paths += hf_dataset_files(item) or [
                os.path.join(item, f) for f in sorted(os.listdir(item))
                if f.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES + TABLE_SUFFIXES)]
        elif os.path.isfile(item):
            paths.append(item)
        else:
            raise FileNotFoundError(f"input not found: {item}")
    return paths


def hf_dataset_files(directory: str) -> list[str]:
    """The .arrow shards of a `datasets.Dataset.save_to_disk` directory, in order ([] for another
    directory); a DatasetDict's directory is an error naming its splits."""
    if os.path.isfile(os.path.join(directory, "dataset_dict.json")):
        with open(os.path.join(directory, "dataset_dict.json")) as f:
            splits = json.load(f).get("splits", [])
        raise ValueError(f"{directory} is a DatasetDict with splits {splits}: give one split's directory, e.g. "
                         f"{os.path.join(directory, splits[0] if splits else 'train')}")
    state = os.path.join(directory, "state.json")
    if not os.path.isfile(state):
        return []
    with open(state) as f:
        shards = [entry["filename"] for entry in json.load(f).get("_data_files", [])]
    return [os.path.join(directory, name) for name in shards]


def is_jsonl(path: str) -> bool:
    """Whether `path` is read as jsonl (one document per line) rather than as one text document."""
    return path.endswith(JSONL_SUFFIXES)


def is_table(path: str) -> bool:
    """Whether `path` is a parquet or arrow table (one document per row)."""
    return path.endswith(TABLE_SUFFIXES)


def stem(path: str) -> str:
    """The file name without its directory and its text/jsonl/table/compression suffixes."""
    name = os.path.basename(path)
    for suffix in sorted(TEXT_SUFFIXES + JSONL_SUFFIXES + TABLE_SUFFIXES + (".gz", ".zst"), key=len, reverse=True):
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


def open_binary(path: str) -> io.BufferedIOBase:
    """`path` opened for reading bytes, decompressed as it is read for .gz and .zst."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def count_documents(path: str) -> int:
    """Document slots in a file: 1 for text, the non-blank lines of jsonl (one streaming pass), the
    rows of a table (parquet's metadata; an arrow stream's batch headers)."""
    if is_table(path):
        return _table_rows(path)
    if not is_jsonl(path):
        return 1
    with open_binary(path) as f:
        return sum(1 for line in f if line.strip())


@dataclass
class Document:
    """One document slot: its name ("file" or "file:line") and text (None: a bad line, skipped)."""

    name: str
    text: str | None


def _parse_line(path: str, line_no: int, line: bytes, json_key: str) -> str:
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadLineError(f"{path}:{line_no}: not valid JSON ({e})") from None
    if not isinstance(value, dict) or json_key not in value:
        got = f"keys {sorted(value)[:5]}" if isinstance(value, dict) else type(value).__name__
        raise BadLineError(f"{path}:{line_no}: expected a JSON object with a {json_key!r} field, got {got}")
    if not isinstance(value[json_key], str):
        raise BadLineError(f"{path}:{line_no}: field {json_key!r} is {type(value[json_key]).__name__}, "
                           f"expected a string")
    return value[json_key]


def _arrow_batches(path: str) -> Iterator:
    """(schema, record batches) of an arrow file, memory-mapped: an IPC stream (what `datasets`
    writes) or an IPC file."""
    import pyarrow as pa

    source = pa.memory_map(path)
    try:
        reader = pa.ipc.open_file(source)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        source.seek(0)
        reader = pa.ipc.open_stream(source)
        return reader.schema, iter(reader)


def _table_rows(path: str) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.endswith(".parquet"):
            return pq.ParquetFile(path).metadata.num_rows
        return sum(batch.num_rows for batch in _arrow_batches(path)[1])
    except pa.ArrowException as e:
        raise ValueError(f"{path}: not a readable {os.path.splitext(path)[1][1:]} table ({e})") from None


def _table_batches(path: str, column: str) -> Iterator:
    """The record batches of a parquet or arrow file, `column` only, a batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.endswith(".parquet"):
            table = pq.ParquetFile(path)
            _check_column(path, column, table.schema_arrow.names)
            yield from table.iter_batches(batch_size=TABLE_BATCH_ROWS, columns=[column])
            return
        schema, batches = _arrow_batches(path)
        _check_column(path, column, schema.names)
        for batch in batches:
            yield batch.select([column])
    except pa.ArrowException as e:
        raise ValueError(f"{path}: not a readable {os.path.splitext(path)[1][1:]} table ({e})") from None


def _check_column(path: str, column: str, names: list[str]) -> None:
    if column not in names:
        raise BadLineError(f"{path}: no column {column!r} (columns: {names[:10]}); choose one with --json-key")


def _table_documents(path: str, column: str, skip_bad_lines: bool) -> Iterator[Document]:
    row = 0
    for batch in _table_batches(path, column):
        for value in batch.column(0).to_pylist():
            name = f"{path}:{row}"
            row += 1
            if isinstance(value, str):
                yield Document(name, value)
            elif skip_bad_lines:
                yield Document(name, None)
            else:
                raise BadLineError(f"{path}: row {row - 1}: column {column!r} is {type(value).__name__}, expected "
                                   f"a string")


def read_documents(path: str, json_key: str = "text", skip_bad_lines: bool = False) -> Iterator[Document]:
    """The document slots of one file, streamed (a jsonl file or a table is never read whole). A
    bad line (row) raises BadLineError naming the file and line (row), or with `skip_bad_lines`
    yields an empty slot."""
    if is_table(path):
        yield from _table_documents(path, json_key, skip_bad_lines)
        return
    if not is_jsonl(path):
        with open_binary(path) as f:
            yield Document(path, f.read().decode("utf-8").replace("\r\n", "\n"))
        return
    with open_binary(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield Document(f"{path}:{line_no}", _parse_line(path, line_no, line, json_key))
            except BadLineError:
                if not skip_bad_lines:
                    raise
                yield Document(f"{path}:{line_no}", None)


def partition(files: list[str], partitions: int, index: int) -> tuple[int, int]:
    """[first, end) of the files partition `index` of `partitions` processes: contiguous blocks,
    so partitions 0, 1, ... joined in order are the files in order."""
    if not 0 <= index < partitions:
        raise ValueError(f"--partition-index {index} is outside [0, {partitions})")
    if partitions > len(files):
        raise ValueError(f"--partitions {partitions} is more than the {len(files)} input files")
    return index * len(files) // partitions, (index + 1) * len(files) // partitions
