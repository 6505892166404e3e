"""Tokenize a corpus into indexed memory-mapped datasets (train/valid split by documents).

Input: text files (one document each) and/or .jsonl files (one {"text": ...} document per line),
given as files or directories. Output, for --output-prefix P:
  P_tokenizer.model/.vocab         sentencepiece BPE (trained on the train documents, unless
                                   --tokenizer-model names one to reuse)
  P_train_text_document.bin/.idx   train documents, each ending with the end-of-document token
  P_valid_text_document.bin/.idx   validation documents
  P_stats.json                     token counts and the unigram entropy of the train tokens
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

import numpy as np

from megazero.data import SentencePieceTokenizer, best_dtype, train_sentencepiece, write_indexed_dataset


def read_documents(inputs: list[str]) -> list[tuple[str, str]]:
    """(name, text) of every document in the given files and directories, in sorted order."""
    paths = []
    for item in inputs:
        if os.path.isdir(item):
            paths += [os.path.join(item, f) for f in sorted(os.listdir(item)) if f.endswith((".txt", ".jsonl"))]
        elif os.path.isfile(item):
            paths.append(item)
        else:
            sys.exit(f"input not found: {item}")
    documents = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".jsonl"):
                for line_no, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            documents.append((f"{path}:{line_no}", json.loads(line)["text"]))
                        except (json.JSONDecodeError, KeyError) as e:
                            sys.exit(f"{path}:{line_no}: expected a JSON object with a 'text' field ({e})")
            else:
                documents.append((path, f.read().replace("\r\n", "\n")))
    if not documents:
        sys.exit(f"no documents found in {inputs}")
    return documents


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> list[str]:
    """Sentences of a text: split after '.', '!' or '?' followed by white space (kept whole otherwise)."""
    return [s for s in _SENTENCE_END.split(text) if s.strip()]


def split_documents(documents: list, valid_fraction: float, seed: int) -> tuple[list, list]:
    """Shuffle documents with `seed` and hold out round(n * valid_fraction) (at least 1) for validation."""
    if len(documents) < 2:
        sys.exit("need at least 2 documents to split into train and validation")
    order = np.random.default_rng(seed).permutation(len(documents))
    n_valid = min(len(documents) - 1, max(1, round(len(documents) * valid_fraction)))
    valid = [documents[i] for i in sorted(order[:n_valid])]
    train = [documents[i] for i in sorted(order[n_valid:])]
    return train, valid


def unigram_entropy(token_arrays: list[np.ndarray], vocab_size: int) -> float:
    """Entropy (nats/token) of the token frequency distribution: the loss of the best unigram model."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for tokens in token_arrays:
        counts += np.bincount(tokens, minlength=vocab_size)
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * np.log(probs)).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="text/jsonl files or directories")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--tokenizer-model", default=None, help="reuse this sentencepiece model")
    parser.add_argument("--valid-fraction", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--split-sentences", action="store_true",
                        help="BERT: one sequence per sentence, grouped by document (P_{train,valid}_text_sentence)")
    parser.add_argument("--special-tokens", nargs="*", default=[],
                        help="pieces of their own in a newly trained tokenizer, e.g. [CLS] [SEP] [MASK] [PAD]")
    args = parser.parse_args()

    documents = read_documents(args.input)
    train, valid = split_documents(documents, args.valid_fraction, args.seed)
    model_path = args.tokenizer_model
    if model_path is None:
        os.makedirs(os.path.dirname(args.output_prefix) or ".", exist_ok=True)
        corpus = args.output_prefix + "_tokenizer_corpus.txt"
        with open(corpus, "w", encoding="utf-8") as f:
            for _, text in train:
                f.write(text + "\n")
        model_path = train_sentencepiece([corpus], args.output_prefix + "_tokenizer", args.vocab_size,
                                         special_tokens=args.special_tokens)
        os.remove(corpus)
    tokenizer = SentencePieceTokenizer(model_path)
    dtype = best_dtype(tokenizer.vocab_size)
    stats = {"tokenizer_model": model_path, "vocab_size": tokenizer.vocab_size}
    for split, docs in (("train", train), ("valid", valid)):
        if args.split_sentences:
            arrays, doc_idx = [], [0]
            for _, text in docs:
                arrays += [np.array(ids, dtype=dtype) for ids in map(tokenizer.encode, split_sentences(text)) if ids]
                doc_idx.append(len(arrays))
            write_indexed_dataset(f"{args.output_prefix}_{split}_text_sentence", arrays, dtype, doc_idx)
        else:
            arrays = [np.array(tokenizer.encode(text) + [tokenizer.eod], dtype=dtype) for _, text in docs]
            write_indexed_dataset(f"{args.output_prefix}_{split}_text_document", arrays, dtype)
        stats[split] = {"documents": len(docs), "tokens": int(sum(len(a) for a in arrays)),
                        "characters": sum(len(t) for _, t in docs), "names": [n for n, _ in docs]}
        if split == "train":
            stats["unigram_entropy_nats"] = unigram_entropy(arrays, tokenizer.vocab_size)
    with open(args.output_prefix + "_stats.json", "w") as f:
        json.dump(stats, f, indent=1)
    print(f"train: {stats['train']['documents']} documents, {stats['train']['tokens']:,} tokens; "
          f"valid: {stats['valid']['documents']} documents, {stats['valid']['tokens']:,} tokens; "
          f"unigram entropy {stats['unigram_entropy_nats']:.3f} nats; tokenizer {model_path}")
    print(f"chars/token {stats['train']['characters'] / stats['train']['tokens']:.2f}; "
          f"unigram perplexity {math.exp(stats['unigram_entropy_nats']):.0f}")


if __name__ == "__main__":
    main()
