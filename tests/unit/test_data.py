"""Tokenizer, indexed dataset, GPT samples and the data-parallel loader."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megazero.data import (
    DatasetFormatError,
    DistributedBatchLoader,
    GPTDataset,
    IndexedDataset,
    SentencePieceTokenizer,
    write_indexed_dataset,
)
from tests.conftest import REPO


def test_corpus_round_trip(corpus_prefix):
    """decode(tokens of the dataset) reproduces each source text exactly."""
    import json

    stats = json.load(open(corpus_prefix + "_stats.json"))
    tokenizer = SentencePieceTokenizer(corpus_prefix + "_tokenizer.model")
    assert tokenizer.vocab_size == 8000
    for split in ("train", "valid"):
        dataset = IndexedDataset(f"{corpus_prefix}_{split}_text_document")
        assert len(dataset) == stats[split]["documents"] and dataset.dtype == np.uint16
        assert dataset.num_tokens == stats[split]["tokens"]
        for doc_index in (0, len(dataset) - 1):
            name = stats[split]["names"][doc_index]
            text = open(name, encoding="utf-8").read().replace("\r\n", "\n")
            tokens = dataset[doc_index]
            assert tokens[-1] == tokenizer.eod
            assert tokenizer.decode(tokens) == text
    assert stats["valid"]["documents"] >= 1 and stats["train"]["tokens"] > 1_000_000
    assert 5.0 < stats["unigram_entropy_nats"] < 8.0


def test_indexed_dataset_round_trip(tmp_path):
    docs = [np.arange(n, dtype=np.int32) * 7 for n in (5, 1, 300)]
    prefix = str(tmp_path / "d")
    write_indexed_dataset(prefix, docs, np.int32)
    ds = IndexedDataset(prefix)
    assert len(ds) == 3 and ds.num_tokens == 306
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
    assert list(ds.document_indices) == [0, 1, 2, 3]


def test_truncated_or_mismatched_files_name_the_file(tmp_path):
    prefix = str(tmp_path / "d")
    write_indexed_dataset(prefix, [np.arange(100, dtype=np.uint16)], np.uint16)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(150)
    with pytest.raises(DatasetFormatError, match=r"d\.bin: 150 bytes, but .*d\.idx describes 200"):
        IndexedDataset(prefix)
    write_indexed_dataset(prefix, [np.arange(100, dtype=np.uint16)], np.uint16)
    data = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(data[:-4])
    with pytest.raises(DatasetFormatError, match=r"d\.idx: .* truncated"):
        IndexedDataset(prefix)
    open(prefix + ".idx", "wb").write(b"NOTANIDX" + data[8:])
    with pytest.raises(DatasetFormatError, match="bad magic"):
        IndexedDataset(prefix)
    os.remove(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=r"d\.bin"):
        IndexedDataset(prefix)


def test_gpt_samples_are_shifted_windows(tmp_path):
    prefix = str(tmp_path / "d")
    write_indexed_dataset(prefix, [np.arange(0, 50, dtype=np.uint16), np.arange(50, 101, dtype=np.uint16)],
                          np.uint16)
    ds = GPTDataset(IndexedDataset(prefix), seq_length=10, seed=3)
    assert len(ds) == 10  # 101 tokens -> (101 - 1) // 10 windows
    seen = set()
    for i in range(len(ds)):
        sample = ds[i]
        window = ds.window_of(i)
        assert sample["input_ids"].tolist() == list(range(window * 10, window * 10 + 10))
        assert sample["labels"].tolist() == list(range(window * 10 + 1, window * 10 + 11))
        seen.add(window)
    assert seen == set(range(10))  # one epoch visits every window once
    assert [ds.window_of(i) for i in range(10)] != list(range(10))  # shuffled
    again = GPTDataset(IndexedDataset(prefix), seq_length=10, seed=3)
    assert [again.window_of(i) for i in range(30)] == [ds.window_of(i) for i in range(30)]  # deterministic
    assert sorted(ds.window_of(i) for i in range(10, 20)) == list(range(10))  # epoch 2


def _ids(loader, n):
    it = iter(loader)
    return [next(it)["input_ids"][:, 0].tolist() for _ in range(n)]


def test_loader_slices_ranks_without_overlap_and_resumes(tmp_path):
    prefix = str(tmp_path / "d")
    write_indexed_dataset(prefix, [np.arange(0, 1001, dtype=np.uint16)], np.uint16)
    ds = GPTDataset(IndexedDataset(prefix), seq_length=10, shuffle=False)
    loaders = [DistributedBatchLoader(ds, micro_batch_size=2, dp_rank=r, dp_size=3) for r in range(3)]
    per_rank = [_ids(loader, 4) for loader in loaders]
    firsts = sorted(x for rank in per_rank for batch in rank for x in batch)
    assert firsts == [10 * i for i in range(24)]  # every sample once, none twice
    assert per_rank[1][0] == [20, 30]
    resumed = DistributedBatchLoader(ds, micro_batch_size=2, dp_rank=1, dp_size=3)
    resumed.set_consumed_samples(12)  # two global micro-batches done
    assert _ids(resumed, 2) == per_rank[1][2:]
    bounded = DistributedBatchLoader(ds, micro_batch_size=2, dp_rank=0, dp_size=3, num_samples=13)
    assert len(list(bounded)) == 2 == len(bounded)


def test_sentence_preprocessing_with_special_tokens(tmp_path):
    """--split-sentences: one sequence per sentence, grouped by document; the tokenizer has the
    BERT pieces, each encoded as one id."""
    import subprocess
    import sys

    from megazero.data import SentencePieceTokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = "".join(f"The {w} came home. Was it late? It was {w}!\nAnd so on.\n" for w in
                   ["king", "queen", "fool", "ghost", "duke", "maid"] * 40)
    for name in ("a", "b", "c"):
        (corpus / f"{name}.txt").write_text(text)
    prefix = str(tmp_path / "bert")
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "preprocess_data.py"), "--input", str(corpus),
                    "--output-prefix", prefix, "--vocab-size", "300", "--valid-fraction", "0.34",
                    "--split-sentences", "--special-tokens", "[CLS]", "[SEP]", "[MASK]", "[PAD]"], check=True)
    tokenizer = SentencePieceTokenizer(prefix + "_tokenizer.model")
    ids = {piece: tokenizer.token_id(piece) for piece in ("[CLS]", "[SEP]", "[MASK]", "[PAD]")}
    assert len(set(ids.values())) == 4
    assert tokenizer.encode("a [MASK] b").count(ids["[MASK]"]) == 1
    with pytest.raises(ValueError, match="no piece"):
        tokenizer.token_id("[NOPE]")
    train = IndexedDataset(prefix + "_train_text_sentence")
    assert list(train.document_indices) == [0, 960, 1920]  # 2 documents x 240 lines x 4 sentences
    assert tokenizer.decode(train[1]).strip() == "Was it late?"


def test_loader_over_a_plain_dataset_is_one_epoch_per_iteration():
    """A map-style dataset that is not a MultiEpochDataset: `for batch in loader` ends after one
    pass (DeepSpeed's tutorial loop), the next pass continues the stream, and a resumed loader ends
    its pass where the uninterrupted one does."""
    samples = [{"x": torch.tensor([i])} for i in range(10)]
    rank1 = DistributedBatchLoader(samples, micro_batch_size=2, dp_rank=1, dp_size=2)
    first = [batch["x"].flatten().tolist() for batch in rank1]
    assert first == [[2, 3], [6, 7]] and len(rank1) == 2  # 10 // 4 micro-batches per rank, then stop
    second = [batch["x"].flatten().tolist() for batch in rank1]
    assert second == [[0, 1], [4, 5]]  # samples 8..15 wrap around the dataset
    resumed = DistributedBatchLoader(samples, micro_batch_size=2, dp_rank=1, dp_size=2)
    resumed.set_consumed_samples(4)
    assert [batch["x"].flatten().tolist() for batch in resumed] == first[1:]
    with pytest.raises(ValueError, match="fewer than one global micro-batch"):
        list(DistributedBatchLoader(samples[:3], micro_batch_size=2, dp_rank=0, dp_size=2))
