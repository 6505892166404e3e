"""BERT learns sentence order: a seeded tiny BERT (dropout 0.1) trained 200 steps through the engine
on the synthetic sentence documents predicts the order of held-out pairs above chance.

Why the bound: each held-out pair is swapped or not by its own fair coin (drawn from the dataset's
seed and the pair's index, independent of the model), so a model that has learned nothing gets
Binomial(n, 1/2) pairs right: mean n/2, standard deviation sqrt(n/4). Requiring more than
1/2 + 3 sqrt(0.25 / n) correct leaves such a model a 0.13% chance of passing."""

from __future__ import annotations

import math

import pytest
import torch

import megazero
from megazero.data import IndexedDataset
from megazero.data.bert_dataset import BertDataset
from models.bert import BertConfig
from models.parallelize import parallelize
from tests.bert_helpers import SPECIAL, TINY_BERT, write_sentence_dataset

pytestmark = pytest.mark.slow  # about 25 s on one core
STEPS = 200


def sentence_order_accuracy(engine, dataset: BertDataset) -> float:
    """Fraction of the dataset's pairs whose order the model gets right (eval mode, one batch)."""
    engine.eval()
    with torch.no_grad():
        batch = {key: torch.stack([dataset[i][key] for i in range(len(dataset))]) for key in dataset[0]}
        correct = engine.module.losses(**batch)["sop_correct"].item()
    engine.train()
    return correct / len(dataset)


def test_sentence_order_accuracy_beats_chance(tmp_path):
    train = BertDataset(IndexedDataset(write_sentence_dataset(str(tmp_path / "train"))), TINY_BERT["seq_length"],
                        SPECIAL, TINY_BERT["vocab_size"], seed=0, binary_head="sop")
    # 200 other documents, each chunk once (one epoch, unshuffled): independent held-out pairs
    held_out = BertDataset(IndexedDataset(write_sentence_dataset(str(tmp_path / "held_out"), seed=1, documents=200)),
                           TINY_BERT["seq_length"], SPECIAL, TINY_BERT["vocab_size"], seed=1, binary_head="sop",
                           shuffle=False)
    megazero.set_seed(0)
    model = parallelize(BertConfig(**{**TINY_BERT, "dropout": 0.1, "binary_head": "sop"}))
    engine, _, loader, _ = megazero.initialize(model=model, training_data=train, config={
        "train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 20}},
        "gradient_clipping": 1.0, "steps_per_print": 10_000})
    before = sentence_order_accuracy(engine, held_out)
    data = iter(loader)
    losses = [engine.train_batch(data).item() for _ in range(STEPS)]
    after = sentence_order_accuracy(engine, held_out)
    n = len(held_out)
    bound = 0.5 + 3 * math.sqrt(0.25 / n)
    assert n >= 200 and losses[-1] < losses[0]
    assert after > bound, f"sentence-order accuracy {after:.3f} on {n} held-out pairs (before training " \
                          f"{before:.3f}), needs > {bound:.3f}"
