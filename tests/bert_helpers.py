"""A synthetic sentence-level dataset and a BERT training function for the test pools."""

from __future__ import annotations

import numpy as np

import megazero
from megazero import parallel_state
from megazero.data import IndexedDataset, write_indexed_dataset
from megazero.data.bert_dataset import BertDataset
from models.bert import BertConfig
from models.parallelize import parallelize
from tests.training_helpers import full_parameters, global_mean

SPECIAL = {"[CLS]": 0, "[SEP]": 1, "[MASK]": 2, "[PAD]": 3}
TINY_BERT = dict(vocab_size=256, seq_length=32, num_layers=2, hidden_size=64, num_attention_heads=4,
                 make_vocab_size_divisible_by=64, dropout=0.1)


def write_sentence_dataset(prefix: str, seed: int = 0, documents: int = 30) -> str:
    """`documents` documents of 3-8 sentences; each sentence counts up from a random start (ids
    4..255), and each document's sentences start ever higher, so sentence order is learnable."""
    rng = np.random.default_rng(seed)
    sentences, doc_idx = [], [0]
    for _ in range(documents):
        start = int(rng.integers(4, 60))
        for _ in range(int(rng.integers(3, 9))):
            length = int(rng.integers(3, 8))
            sentences.append(np.arange(start, start + length, dtype=np.uint16) % 252 + 4)
            start += length + int(rng.integers(1, 20))
        doc_idx.append(len(sentences))
    write_indexed_dataset(prefix, sentences, np.uint16, doc_idx)
    return prefix


def bert_dataset(prefix: str, seed: int = 0) -> BertDataset:
    """BertDataset over the synthetic sentences with TINY_BERT's sequence length."""
    return BertDataset(IndexedDataset(prefix), TINY_BERT["seq_length"], SPECIAL, TINY_BERT["vocab_size"], seed=seed)


def train_bert(config: dict, prefix: str, steps: int, layout: tuple[int, int] | None = None,
               model_overrides: dict | None = None, save_dir: str | None = None) -> dict:
    """Seeded tiny BERT trained `steps` optimizer steps; per-step global losses and final parameters
    (saved as a checkpoint in save_dir when given)."""
    megazero.set_seed(0)
    overrides = {**(model_overrides or {}), "tensor_model_parallel_size": layout[0] if layout else 1}
    grid = parallel_state.initialize_model_parallel(
        *layout, context_parallel_size=overrides.get("context_parallel_size", 1)) if layout else None
    model = parallelize(BertConfig(**{**TINY_BERT, **overrides}), grid)
    engine, _, loader, _ = megazero.initialize(model=model, training_data=bert_dataset(prefix), config=config,
                                               mpu=parallel_state if grid else None)
    data = iter(loader)
    losses = [global_mean(engine.train_batch(data).item(), engine) for _ in range(steps)]
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    return {"losses": losses, "params": full_parameters(engine)}
