"""BertDataset's next-sentence pairs: a "random next" B always comes from another document (on an
indexed dataset whose documents use disjoint token ids, so each token names its document)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megazero.data import IndexedDataset, write_indexed_dataset
from megazero.data.bert_dataset import BertDataset
from tests.bert_helpers import SPECIAL

IDS_PER_DOCUMENT = 30


def write_disjoint_documents(prefix: str, sentences_per_document: list[int]) -> str:
    """Document d's sentences use only the token ids 4 + 30 d ... 4 + 30 d + 29."""
    rng = np.random.default_rng(0)
    sentences, doc_idx = [], [0]
    for d, count in enumerate(sentences_per_document):
        low = 4 + IDS_PER_DOCUMENT * d
        for _ in range(count):
            sentences.append(rng.integers(low, low + IDS_PER_DOCUMENT, size=int(rng.integers(3, 9)), dtype=np.uint16))
        doc_idx.append(len(sentences))
    write_indexed_dataset(prefix, sentences, np.uint16, doc_idx)
    return prefix


def segment_documents(item: dict[str, torch.Tensor]) -> tuple[set[int], set[int]]:
    """The documents of segment A's and segment B's original (unmasked) tokens."""
    original = torch.where(item["loss_mask"] > 0, item["labels"], item["input_ids"])
    tokens = original[: int(item["padding_mask"].sum())].tolist()
    first_sep = tokens.index(SPECIAL["[SEP]"])
    a, b = tokens[1:first_sep], tokens[first_sep + 1:-1]
    document = lambda ids: {(t - 4) // IDS_PER_DOCUMENT for t in ids}  # noqa: E731
    return document(a), document(b)


# 8 documents of very different lengths (document 3 has one sentence, hence no chunk): a draw over
# all chunks would pick A's own document for about a quarter of the random samples
SENTENCES = [40, 6, 12, 1, 25, 3, 8, 2]


def test_nsp_random_next_always_comes_from_another_document(tmp_path):
    dataset = BertDataset(IndexedDataset(write_disjoint_documents(str(tmp_path / "docs"), SENTENCES)), 32, SPECIAL,
                          256, seed=5, binary_head="nsp")
    n = 5 * len(dataset)  # five epochs: every chunk with five different splits and draws
    random_next, b_documents = 0, set()
    for i in range(n):
        item = dataset[i]
        a, b = segment_documents(item)
        assert len(a) == 1 and len(b) == 1, f"sample {i}: a segment spans documents {a} / {b}"
        if item["sentence_order"]:
            assert a != b, f"sample {i} is labelled random but B is from A's document {a}"
            b_documents |= b
            random_next += 1
        else:
            assert a == b, f"sample {i}: the true next B is from document {b}, A from {a}"
    assert abs(random_next / n - 0.5) < 4 * math.sqrt(0.25 / n), f"{random_next} of {n} random"
    assert b_documents == {0, 1, 2, 4, 5, 6, 7}, "random Bs are drawn from every document with chunks"


def test_nsp_needs_two_documents_with_chunks(tmp_path):
    prefix = write_disjoint_documents(str(tmp_path / "one"), [20, 1])  # document 1: too short for a chunk
    with pytest.raises(ValueError, match="only document 0 has chunks.*binary_head='sop'"):
        BertDataset(IndexedDataset(prefix), 32, SPECIAL, 256, binary_head="nsp")
    sop = BertDataset(IndexedDataset(prefix), 32, SPECIAL, 256, binary_head="sop")  # SOP needs one document
    assert all(segment_documents(sop[i]) == ({0}, {0}) for i in range(len(sop)))
    with pytest.raises(ValueError, match="binary_head must be 'sop' or 'nsp', got 'mlm'"):
        BertDataset(IndexedDataset(prefix), 32, SPECIAL, 256, binary_head="mlm")
