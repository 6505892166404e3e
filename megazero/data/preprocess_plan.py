"""Which documents go to which output, for scripts/preprocess_data.py and merge_datasets.py.

A run's inputs become outputs ("groups"): one merged dataset family P_..., one per input file
(P_<file stem>_...), or with `--partitions K --partition-index i` the i-th contiguous block of the
input files (P_part<i>of<K>_...), whose documents keep their numbers in the whole input so the
train/valid split is the whole run's. merge_partitions() joins the K outputs into the family a
single run writes, byte for byte (.bin, .idx and _stats.json).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from megazero.data.indexed_dataset import IndexedDataset, merge_indexed_datasets
from megazero.data.preprocess import (
    NAMES_KEPT,
    Options,
    output_names,
    token_counts,
    tokenize_files,
    unigram_entropy,
    valid_mask,
    write_tokenizer_corpus,
)
from megazero.data.sources import count_documents, partition, stem
from megazero.data.tokenizer import TokenizerSpec


@dataclass
class Group:
    """One output: its prefix, files, the number of its first document in the split's numbering,
    its document count and the split's valid mask (None: no split)."""

    prefix: str
    files: list[str]
    first_document: int
    documents: int
    mask: np.ndarray | None


def partition_prefix(prefix: str, index: int, partitions: int) -> str:
    """The output prefix of partition `index` of `partitions`."""
    return f"{prefix}_part{index}of{partitions}"


def plan(files: list[str], prefix: str, opts: Options, per_input: bool = False, partitions: int = 1,
         index: int = 0) -> tuple[list[Group], list[Group]]:
    """(every group of the whole input, the groups this run writes)."""
    counts = [count_documents(f) for f in files]
    if per_input:
        every = []
        for f, n in zip(files, counts):
            if opts.valid_fraction and n < 2:
                raise ValueError(f"{f}: {n} document(s): --output-per-input splits each file into train and "
                                 f"validation and needs at least 2 (or --valid-fraction 0)")
            mask = valid_mask(n, opts.valid_fraction, opts.seed) if opts.valid_fraction else None
            every.append(Group(f"{prefix}_{stem(f)}", [f], 0, n, mask))
        first, end = partition(every, partitions, index)
        return every, every[first:end]
    total = sum(counts)
    if total == 0:
        raise ValueError(f"no documents found in {files}")
    mask = valid_mask(total, opts.valid_fraction, opts.seed) if opts.valid_fraction else None
    whole = Group(prefix, files, 0, total, mask)
    if partitions == 1:
        return [whole], [whole]
    first, end = partition(files, partitions, index)
    part = Group(partition_prefix(prefix, index, partitions), files[first:end], sum(counts[:first]),
                 sum(counts[first:end]), mask)
    return [whole], [part]


def train_tokenizer(groups: list[Group], prefix: str, opts: Options, vocab_size: int, special_tokens: list[str],
                    max_bytes: int) -> str:
    """A sentencepiece model P_tokenizer.model trained on the train documents of `groups` (the
    first `max_bytes` of their text); returns its path."""
    from megazero.data.tokenizer_sentencepiece import train_sentencepiece

    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    corpus = prefix + "_tokenizer_corpus.txt"
    written = 0
    with open(corpus, "w", encoding="utf-8") as f:
        for group in groups:
            if written < max_bytes:
                written += write_tokenizer_corpus(group.files, f, opts, group.mask, max_bytes - written,
                                                  group.first_document)
    try:
        return train_sentencepiece([corpus], prefix + "_tokenizer", vocab_size, special_tokens=special_tokens)
    finally:
        os.remove(corpus)


def write_group(group: Group, spec: TokenizerSpec, opts: Options) -> dict:
    """Tokenize one group and write its datasets and P_stats.json; returns the stats."""
    stats = tokenize_files(group.files, group.prefix, spec, opts, group.mask, group.documents,
                           group.first_document)
    with open(group.prefix + "_stats.json", "w") as f:
        json.dump(stats, f, indent=1)
    return stats


def layout_of(prefix: str) -> Options:
    """The Options (sentences or documents, split or not) whose outputs exist for `prefix`."""
    for sentences in (False, True):
        for fraction in (0.05, 0):
            opts = Options(split_sentences=sentences, valid_fraction=fraction)
            if os.path.isfile(output_names(prefix, opts)[0] + ".idx"):
                return opts
    raise FileNotFoundError(f"no preprocessed dataset found for prefix {prefix} "
                            f"(expected e.g. {prefix}_train_text_document.idx)")


def merge_partitions(prefixes: list[str], output_prefix: str) -> dict:
    """Join the datasets and stats of `prefixes` (partitions, in order) into output_prefix; returns
    the merged stats."""
    parts = []
    for p in prefixes:
        path = p + "_stats.json"
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: is partition {p} complete?")
        with open(path) as f:
            parts.append(json.load(f))
    splits = [k for k in ("train", "valid", "all") if k in parts[0]]
    opts = layout_of(prefixes[0])
    for suffix_index, name in enumerate(output_names(output_prefix, opts)):
        merge_indexed_datasets([output_names(p, opts)[suffix_index] for p in prefixes], name)
    merged = {key: parts[0][key] for key in ("tokenizer", "tokenizer_model", "vocab_size") if key in parts[0]}
    for split in splits:
        entry = {key: sum(p[split][key] for p in parts) for key in ("documents", "tokens", "characters")}
        if entry["documents"] <= NAMES_KEPT:
            entry["names"] = [n for p in parts for n in p[split]["names"]]
        merged[split] = entry
        if split in ("train", "all"):
            counts = token_counts(IndexedDataset(output_names(output_prefix, opts)[0]), merged["vocab_size"])
            merged["unigram_entropy_nats"] = unigram_entropy(counts)
    skipped = sum(p.get("skipped_bad_lines", 0) for p in parts)
    if skipped:
        merged["skipped_bad_lines"] = skipped
    with open(output_prefix + "_stats.json", "w") as f:
        json.dump(merged, f, indent=1)
    return merged
