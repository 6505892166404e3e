"""Preprocessing inputs: which files, how to open them (.gz, .zst) and the documents they hold.

A text file (.txt) is one document. A jsonl file (.jsonl, .jsonl.gz, .jsonl.zst) holds one document
per non-blank line, a JSON object whose `json_key` field is the text. Every non-blank line is one
document slot, so that the document numbering (and the train/valid split drawn over it) does not
depend on which lines turn out to be bad: a bad line skipped with `skip_bad_lines` is an empty
slot, counted and reported, never silently dropped.
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


class BadLineError(ValueError):
    """A jsonl line that is not a JSON object with a string under the key (names file and line)."""


def input_files(inputs: list[str]) -> list[str]:
    """The files named, and those in the named directories (text and jsonl, sorted), in order."""
    paths = []
    for item in inputs:
        if os.path.isdir(item):
            paths += [os.path.join(item, f) for f in sorted(os.listdir(item))
                      if f.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES)]
        elif os.path.isfile(item):
            paths.append(item)
        else:
            raise FileNotFoundError(f"input not found: {item}")
    return paths


def is_jsonl(path: str) -> bool:
    """Whether `path` is read as jsonl (one document per line) rather than as one text document."""
    return path.endswith(JSONL_SUFFIXES)


def stem(path: str) -> str:
    """The file name without its directory and its text/jsonl/compression suffixes."""
    name = os.path.basename(path)
    for suffix in sorted(TEXT_SUFFIXES + JSONL_SUFFIXES + (".gz", ".zst"), key=len, reverse=True):
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
    """Document slots in a file: 1 for text, the non-blank lines of jsonl (one streaming pass)."""
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


def read_documents(path: str, json_key: str = "text", skip_bad_lines: bool = False) -> Iterator[Document]:
    """The document slots of one file, streamed (a jsonl file is never read whole). A bad line
    raises BadLineError naming the file and line, or with `skip_bad_lines` yields an empty slot."""
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
