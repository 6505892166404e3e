"""From the recipes' data flags to train, valid and test datasets.

A prefix P names either a preprocessed family, P_train_text_{kind} and P_valid_text_{kind} (what
scripts/preprocess_data.py writes by default), or one dataset, P (or P_text_{kind}), that
Megatron's `--split 969,30,1` cuts into train, valid and test documents. `--data-path` takes one
prefix or weight-prefix pairs; the train parts of several are blended by weight, and each valid
(and test) part is kept apart, so validation reports a loss per dataset. `--train-data-path`,
`--valid-data-path` and `--test-data-path` name each split's prefixes (datasets used whole)
instead.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from megazero.data.blended_dataset import BlendedDataset, parse_data_path
from megazero.data.indexed_dataset import DocumentRange, IndexedDataset, split_documents
from megazero.data.tokenizer import TokenizerSpec

SPLITS = ("train", "valid", "test")


@dataclass
class DataSplits:
    """The train dataset (blended when several are given), and the valid and test datasets by
    name with their weights (for a weighted mean over them)."""

    train: object
    valid: dict[str, object] = field(default_factory=dict)
    test: dict[str, object] = field(default_factory=dict)
    valid_weights: dict[str, float] = field(default_factory=dict)
    test_weights: dict[str, float] = field(default_factory=dict)
    blend_key: str | None = None


def _is_rank_0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _exists(prefix: str) -> bool:
    return os.path.isfile(prefix + ".idx")


def resolve_prefix(prefix: str, kind: str, split: str) -> dict[str, object]:
    """{split: indexed data} of one --data-path prefix (only the non-empty parts)."""
    if _exists(f"{prefix}_train_text_{kind}"):
        parts = {"train": IndexedDataset(f"{prefix}_train_text_{kind}")}
        if _exists(f"{prefix}_valid_text_{kind}"):
            parts["valid"] = IndexedDataset(f"{prefix}_valid_text_{kind}")
        return parts
    for path in (prefix, f"{prefix}_text_{kind}"):
        if _exists(path):
            whole = IndexedDataset(path)
            documents = len(whole.document_indices) - 1
            ranges = split_documents(split, documents)
            counts = {name: b - a for name, (a, b) in zip(SPLITS, ranges)}
            if _is_rank_0():
                print(f"data: {path}: {documents} documents, --split {split}: "
                      + ", ".join(f"{name} {n}" for name, n in counts.items()), flush=True)
                shares = [float(x) for x in split.replace("/", ",").split(",")] + [0.0] * 3
                for (name, n), share in zip(counts.items(), shares):
                    if share > 0 and n == 0:
                        warnings.warn(f"--split {split} gives {path}'s {name} part no document of its {documents}: "
                                      f"there is no {name} set (give it a larger share, or a --{name}-data-path)",
                                      stacklevel=2)
            return {name: DocumentRange(whole, a, b) for name, (a, b) in zip(SPLITS, ranges) if b > a}
    raise FileNotFoundError(f"--data-path {prefix}: found neither {prefix}_train_text_{kind}.idx (a preprocessed "
                            f"train/valid family) nor {prefix}.idx or {prefix}_text_{kind}.idx (one dataset, "
                            f"cut by --split)")


def _names(prefixes: list[str]) -> list[str]:
    """Short unique names for the datasets (file names; numbered where two are the same)."""
    names = [os.path.basename(p) for p in prefixes]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


def default_tokenizer(prefix: str) -> TokenizerSpec:
    """The tokenizer of data prefix P: P_tokenizer.model, else the one P_stats.json names (any type;
    an output of --output-per-input or --partitions, or data made with a given tokenizer), else
    that of P without _text_document/_text_sentence (and then without _train/_valid/_test)."""
    candidates = [prefix] + [prefix[:-len(s)] for s in ("_text_document", "_text_sentence") if prefix.endswith(s)]
    # P_train_text_document given whole (Megatron's one-dataset prefix, cut by --split): P's tokenizer
    candidates += [c[:-len(s)] for c in candidates[1:] for s in ("_train", "_valid", "_test") if c.endswith(s)]
    for p in candidates:
        if os.path.isfile(p + "_tokenizer.model"):
            return TokenizerSpec(model=p + "_tokenizer.model")
        if os.path.isfile(p + "_stats.json"):
            with open(p + "_stats.json") as f:
                stats = json.load(f)
            if "tokenizer" in stats:
                return TokenizerSpec(**stats["tokenizer"])
            if stats.get("tokenizer_model") and os.path.isfile(stats["tokenizer_model"]):
                return TokenizerSpec(model=stats["tokenizer_model"])
    return TokenizerSpec(model=prefix + "_tokenizer.model")


def first_prefix(args) -> str | None:
    """The first prefix named by --data-path or --train-data-path (for the default tokenizer)."""
    values = getattr(args, "data_path", None) or getattr(args, "train_data_path", None)
    return parse_data_path(values)[1][0] if values else None


def build_splits(args, kind: str, make: Callable[[object, str], object], train_samples: int,
                 description: dict | None = None) -> DataSplits:
    """Datasets from args.data_path (with args.split) or args.{train,valid,test}_data_path;
    make(indexed data, split) builds one sample dataset; a blend of several train datasets has
    a block of `train_samples` samples (its index cached under the first prefix's directory)."""
    per_split: dict[str, tuple[list[float], list[str], list[object]]] = {}
    if getattr(args, "data_path", None):
        weights, prefixes = parse_data_path(args.data_path)
        parts = [resolve_prefix(p, kind, args.split) for p in prefixes]
        for split in SPLITS:
            have = [(w, p, part[split]) for w, p, part in zip(weights, prefixes, parts) if split in part]
            if have:
                per_split[split] = tuple(map(list, zip(*have)))
    else:
        for split in SPLITS:
            values = getattr(args, f"{split}_data_path", None)
            if values:
                weights, prefixes = parse_data_path(values, f"--{split}-data-path", unweighted=split != "train")
                per_split[split] = (weights, prefixes, [IndexedDataset(p) for p in prefixes])
    if "train" not in per_split:
        raise ValueError("no training data: give --data-path or --train-data-path")
    weights, prefixes, indexed = per_split["train"]
    datasets = [make(x, "train") for x in indexed]
    out = DataSplits(train=datasets[0])
    if len(datasets) > 1:
        total = sum(weights)
        weights = [w / total for w in weights]
        stamp = [(os.path.abspath(p), os.path.getsize(x.prefix + ".idx"), os.stat(x.prefix + ".idx").st_mtime_ns,
                  getattr(x, "first", 0), getattr(x, "end", None)) for p, x in zip(prefixes, indexed)]
        out.train = BlendedDataset(datasets, weights, train_samples,
                                   os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "blend_cache"),
                                   {"datasets": stamp, "kind": kind, **(description or {})})
        out.blend_key = out.train.key
    for split in ("valid", "test"):
        if split in per_split:
            w, p, x = per_split[split]
            names = _names(p)
            getattr(out, split).update({n: make(d, split) for n, d in zip(names, x)})
            getattr(out, f"{split}_weights").update({n: wi / sum(w) for n, wi in zip(names, w)})
    return out
