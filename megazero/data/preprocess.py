"""Streaming, parallel tokenization of a corpus into indexed datasets (scripts/preprocess_data.py).

The main process reads documents in order and cuts them into chunks of about `chunk_bytes` of
text; `workers` processes tokenize chunks (at most 2 per worker in flight); the results come back
in order and are appended to the .bin files as they arrive, the .idx written at the end from the
sizes collected. Memory is therefore bounded by the chunk size times the chunks in flight (plus 4
bytes per sequence and 1 per document for the index and the split), never by the corpus, and the
output does not depend on the number of workers: chunks are cut and written in the same order.

The train/valid split draws the same permutation of all documents as before streaming (seeded,
round(n * valid_fraction) held out, at least 1), over document numbers counted in a first pass,
so that a partition of the input files (`first_document`) splits exactly as a whole run does.
"""

from __future__ import annotations

import collections
import itertools
import math
import multiprocessing
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TextIO

import numpy as np

from megazero.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, best_dtype
from megazero.data.sources import read_documents
from megazero.data.tokenizer import TokenizerSpec, build_tokenizer

NAMES_KEPT = 10_000  # document names listed in the stats up to this many documents per split
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> list[str]:
    """Sentences of a text: split after '.', '!' or '?' followed by white space (kept whole otherwise)."""
    return [s for s in _SENTENCE_END.split(text) if s.strip()]


def valid_mask(documents: int, valid_fraction: float, seed: int) -> np.ndarray:
    """True for the documents held out for validation: the first round(n * valid_fraction) (at
    least 1, at most n - 1) of a permutation drawn from `seed` (one byte per document)."""
    if documents < 2:
        raise ValueError(f"need at least 2 documents to split into train and validation, found {documents}")
    order = np.random.default_rng(seed).permutation(documents)
    n_valid = min(documents - 1, max(1, round(documents * valid_fraction)))
    mask = np.zeros(documents, dtype=bool)
    mask[order[:n_valid]] = True
    return mask


@dataclass
class Options:
    """How to read and tokenize: see scripts/preprocess_data.py's flags of the same names."""

    json_key: str = "text"
    skip_bad_lines: bool = False
    split_sentences: bool = False
    workers: int = 1
    chunk_bytes: int = 4 << 20
    log_interval: int = 0  # documents between plain progress lines; 0: a tqdm bar
    valid_fraction: float = 0.05  # 0: no split, one P_text_document (split at training time)
    seed: int = 1234


# --- the workers' side: a tokenizer per process, one chunk of texts in, token arrays out ------------

_STATE: dict = {}


def init_worker(spec: TokenizerSpec, split_sentences: bool, threads: int = 1) -> None:
    """Load the tokenizer once per worker process, encoding with `threads` threads where the
    library has them (1 in a pool, whose processes are the parallelism; -1, every core, when
    tokenizing inline)."""
    tokenizer = build_tokenizer(spec, threads)
    _STATE.update(tokenizer=tokenizer, eod=tokenizer.eod, sentences=split_sentences,
                  dtype=best_dtype(tokenizer.vocab_size), vocab=tokenizer.vocab_size)


def _encode_flat(texts: list[str], end: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens back to back, sizes) of encode(text) + [end] for each text (no end: None), the
    texts encoded in one batch call and assembled by C-level iteration (chain, fromiter) rather
    than a Python generator over every token, which cost a quarter of the time of the encode."""
    per_text = _STATE["tokenizer"].encode_batch(texts)
    if end is not None:
        for ids in per_text:
            ids.append(end)
    sizes = np.fromiter(map(len, per_text), np.int64, len(per_text))
    tokens = np.fromiter(itertools.chain.from_iterable(per_text), _STATE["dtype"], int(sizes.sum()))
    return tokens, sizes.astype(np.int32)


@dataclass
class Encoded:
    """One split's part of a chunk: tokens back to back, sequence sizes, document ends (relative
    sequence counts), characters and documents, token counts (for the unigram entropy)."""

    tokens: np.ndarray
    sizes: np.ndarray
    ends: np.ndarray
    characters: int
    counts: np.ndarray


def encode_chunk(chunk: list[tuple[int, str]]) -> dict[int, Encoded]:
    """Tokenize a chunk of (split, text) documents; {split: Encoded} (numpy arrays: cheap to send
    back from a worker, where lists of ints would be pickled one int at a time)."""
    out = {}
    for split in sorted({s for s, _ in chunk}):
        texts = [t for s, t in chunk if s == split]
        if _STATE["sentences"]:
            per_doc = [split_sentences(t) for t in texts]
            tokens, sizes = _encode_flat(list(itertools.chain.from_iterable(per_doc)), None)
            # a sentence that encodes to nothing is no sequence; a document ends after the kept
            # sentences up to its last one (one without any sentence ends where the previous did)
            kept = sizes > 0
            kept_before = np.concatenate([[0], np.cumsum(kept, dtype=np.int64)])
            ends = kept_before[np.cumsum([len(d) for d in per_doc], dtype=np.int64)]
            sizes = sizes[kept]
        else:
            tokens, sizes = _encode_flat(texts, _STATE["eod"])
            ends = np.arange(1, len(sizes) + 1, dtype=np.int64)
        out[split] = Encoded(tokens, sizes, ends.astype(np.int64), sum(len(t) for t in texts),
                             np.bincount(tokens, minlength=_STATE["vocab"]).astype(np.int64))
    return out


def _worker_init(initializer: Callable, initargs: tuple) -> None:
    # a forked worker inherits the parent's Python signal handlers; Pool.terminate() (leaving the
    # `with`) stops workers still waiting for the queue's lock with SIGTERM, which must end them
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    initializer(*initargs)


def ordered_map(fn: Callable, items: Iterable, workers: int, initializer: Callable, initargs: tuple) -> Iterator:
    """fn(item) for each item, in order: inline for 1 worker, else in a process pool with at most
    2 items per worker in flight (Pool.imap would read the whole input ahead)."""
    if workers <= 1:
        initializer(*initargs)
        yield from map(fn, items)
        return
    # never fork this process: it may hold threads (torch's, a logger's) whose locks a forked child
    # would inherit taken; forkserver's workers come from a clean single-threaded server
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(workers, _worker_init, (initializer, initargs)) as pool:
        pending: collections.deque = collections.deque()
        for item in items:
            pending.append(pool.apply_async(fn, (item,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# --- the main process: read, chunk, write ----------------------------------------------------------


@dataclass
class SplitStats:
    """What one output dataset received."""

    documents: int = 0
    tokens: int = 0
    characters: int = 0
    names: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """The stats.json entry (names only up to NAMES_KEPT documents)."""
        out = {"documents": self.documents, "tokens": self.tokens, "characters": self.characters}
        if self.documents <= NAMES_KEPT:
            out["names"] = self.names
        return out


class Progress:
    """A tqdm bar (documents, MB/s, ETA), or with `log_interval` a plain line every that many documents."""

    def __init__(self, total: int, log_interval: int, label: str):
        self.total, self.log_interval, self.label = total, log_interval, label
        self.documents, self.bytes, self.start, self.next_line = 0, 0, time.perf_counter(), log_interval
        self.bar = None
        if not log_interval:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="doc", desc=label, dynamic_ncols=True, disable=None)

    def update(self, documents: int, nbytes: int) -> None:
        """Count `documents` more, of `nbytes` text."""
        self.documents += documents
        self.bytes += nbytes
        rate = self.bytes / 1e6 / max(time.perf_counter() - self.start, 1e-9)
        if self.bar is not None:
            self.bar.update(documents)
            self.bar.set_postfix_str(f"{rate:.1f} MB/s", refresh=False)
        elif self.documents >= self.next_line or self.documents == self.total:
            elapsed = time.perf_counter() - self.start
            eta = elapsed / max(self.documents, 1) * (self.total - self.documents)
            print(f"{self.label}: {self.documents:,}/{self.total:,} documents | {self.bytes / 1e6:,.1f} MB | "
                  f"{rate:.2f} MB/s | {self.documents / max(elapsed, 1e-9):,.0f} docs/s | ETA {eta:.0f} s",
                  flush=True)
            self.next_line = self.documents - self.documents % self.log_interval + self.log_interval

    def close(self) -> None:
        """Close the bar and print the run's totals."""
        if self.bar is not None:
            self.bar.close()
        elapsed = time.perf_counter() - self.start
        print(f"{self.label}: {self.documents:,} documents, {self.bytes / 1e6:,.1f} MB of text in {elapsed:.1f} s "
              f"({self.bytes / 1e6 / max(elapsed, 1e-9):.2f} MB/s)", flush=True)


def _chunks(files: list[str], opts: Options, split_of: Callable[[int], int], first_document: int,
            stats: list[SplitStats], skipped: list[int]) -> Iterator[tuple[list, int]]:
    """(chunk of (split, text), its text bytes) in reading order; records names and bad lines."""
    chunk, size, number = [], 0, first_document
    for path in files:
        for doc in read_documents(path, opts.json_key, opts.skip_bad_lines):
            split = split_of(number)
            number += 1
            if doc.text is None:
                skipped[0] += 1
                continue
            entry = stats[split]
            entry.documents += 1
            if entry.documents <= NAMES_KEPT:
                entry.names.append(doc.name)
            chunk.append((split, doc.text))
            size += len(doc.text)
            if size >= opts.chunk_bytes:
                yield chunk, size
                chunk, size = [], 0
    if chunk:
        yield chunk, size


def output_names(prefix: str, opts: Options) -> list[str]:
    """The dataset prefixes a run writes: P_train/P_valid, or P alone without a split."""
    kind = "sentence" if opts.split_sentences else "document"
    if opts.valid_fraction == 0:
        return [f"{prefix}_text_{kind}"]
    return [f"{prefix}_train_text_{kind}", f"{prefix}_valid_text_{kind}"]


def unigram_entropy(counts: np.ndarray) -> float:
    """Entropy (nats/token) of a token frequency distribution: the loss of the best unigram model."""
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * np.log(probs)).sum())


def tokenize_files(files: list[str], prefix: str, spec: TokenizerSpec, opts: Options, mask: np.ndarray | None,
                   documents: int, first_document: int = 0) -> dict:
    """Tokenize the `documents` document slots of `files` (numbered from `first_document` in the
    whole input; `mask`: its valid documents, None for no split) into output_names(prefix);
    returns the stats."""
    vocab = build_tokenizer(spec).vocab_size
    names = output_names(prefix, opts)
    writers = [IndexedDatasetWriter(name, best_dtype(vocab)) for name in names]
    stats = [SplitStats() for _ in names]
    skipped, counts = [0], np.zeros(vocab, dtype=np.int64)
    split_of = (lambda i: int(mask[i])) if mask is not None else (lambda i: 0)
    progress = Progress(documents, opts.log_interval, prefix)
    chunks = _chunks(files, opts, split_of, first_document, stats, skipped)
    sizes: collections.deque = collections.deque()

    def texts():  # the chunk sizes go round the pool in the same order as the chunks
        for chunk, size in chunks:
            sizes.append((len(chunk), size))
            yield chunk

    try:
        # inline (1 worker), sentencepiece's encode uses every core, as before streaming; in a pool
        # each worker encodes with one thread (the workers are the parallelism)
        threads = 1 if opts.workers > 1 else -1
        for result in ordered_map(encode_chunk, texts(), opts.workers, init_worker,
                                  (spec, opts.split_sentences, threads)):
            for split, part in result.items():
                writers[split].add(part.tokens, part.sizes, part.ends)
                stats[split].tokens += len(part.tokens)
                stats[split].characters += part.characters
                if split == 0:
                    counts += part.counts
            progress.update(*sizes.popleft())
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    progress.close()
    for writer in writers:
        writer.finalize()
    spec = spec.absolute()  # found again by the recipes from any directory
    out = {"tokenizer": spec.to_dict(), "tokenizer_model": spec.model, "vocab_size": vocab}
    for name, entry in zip(["train", "valid"] if mask is not None else ["all"], stats):
        out[name] = entry.as_dict()
        if name in ("train", "all"):
            out["unigram_entropy_nats"] = unigram_entropy(counts)
    if skipped[0]:
        out["skipped_bad_lines"] = skipped[0]
        print(f"{prefix}: skipped {skipped[0]} bad line(s) (--skip-bad-lines)", file=sys.stderr, flush=True)
    return out


def write_tokenizer_corpus(files: list[str], out: TextIO, opts: Options, mask: np.ndarray | None,
                           max_bytes: int, first_document: int = 0) -> int:
    """Write the train documents' text to `out`, each followed by a newline, up to `max_bytes`
    (the tokenizer's training sample, streamed); returns the characters written."""
    written, number = 0, first_document
    for path in files:
        for doc in read_documents(path, opts.json_key, opts.skip_bad_lines):
            number += 1
            if doc.text is None or (mask is not None and mask[number - 1]):
                continue
            out.write(doc.text + "\n")
            written += len(doc.text) + 1
            if written >= max_bytes:
                return written
    return written


def token_counts(indexed: IndexedDataset, vocab_size: int, chunk_tokens: int = 1 << 26) -> np.ndarray:
    """Occurrences of each token id in a dataset's .bin (read in pieces)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, indexed.num_tokens, chunk_tokens):
        counts += np.bincount(indexed.tokens[start:start + chunk_tokens], minlength=vocab_size)
    return counts


def describe(stats: dict) -> str:
    """The tokenizer a stats dict names, for messages."""
    named = TokenizerSpec(**stats["tokenizer"]).describe() if "tokenizer" in stats else stats["tokenizer_model"]
    return f"tokenizer {named}"


def entropy_report(stats: dict) -> str:
    """The summary lines preprocess_data.py prints."""
    first = "train" if "train" in stats else "all"
    lines = [f"{k}: {stats[k]['documents']} documents, {stats[k]['tokens']:,} tokens"
             for k in ("train", "valid", "all") if k in stats]
    entropy = stats["unigram_entropy_nats"]
    return (f"{'; '.join(lines)}; unigram entropy {entropy:.3f} nats; {describe(stats)}\n"
            f"chars/token {stats[first]['characters'] / max(stats[first]['tokens'], 1):.2f}; "
            f"unigram perplexity {math.exp(entropy):.0f}")
