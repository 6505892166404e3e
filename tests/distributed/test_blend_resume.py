"""Exact resume across a blend (issue 20): 2 data-parallel ranks, dropout on, training on a 60/40
blend of two datasets whose block is shorter than the run (so the resumed half also crosses into
the blend's second block), 4 steps straight versus 2, save, and a resume to 4: the same losses and
parameters, bit for bit."""

from __future__ import annotations

import os

import numpy as np
import torch

import megazero
from megazero.data import GPTDataset, IndexedDataset, write_indexed_dataset
from megazero.data.blended_dataset import BlendedDataset
from models.gpt import GPTConfig
from models.parallelize import parallelize
from tests.conftest import write_token_dataset
from tests.training_helpers import TINY, base_config, full_parameters, global_mean


def train_blend(prefixes: list[str], steps: int, save_dir: str, save_at: int | None, load: bool) -> dict:
    """Train the tiny GPT (dropout 0.1) on the blend to `steps`, saving at `save_at` or loading first."""
    megazero.set_seed(0)
    model = parallelize(GPTConfig(**TINY), None)
    datasets = [GPTDataset(IndexedDataset(p), TINY["seq_length"], seed=i) for i, p in enumerate(prefixes)]
    blend = BlendedDataset(datasets, [0.6, 0.4], 10, os.path.join(os.path.dirname(prefixes[0]), "blend_cache"),
                           {"prefixes": prefixes})
    engine, _, loader, _ = megazero.initialize(model=model, training_data=blend,
                                               config=base_config(train_batch_size=4, train_micro_batch_size_per_gpu=2))
    if load:
        engine.load_checkpoint(save_dir)
    data, losses = iter(loader), []
    while engine.global_steps < steps:
        losses.append(global_mean(engine.train_batch(data).item(), engine))
        if engine.global_steps == save_at:
            engine.save_checkpoint(save_dir, client_state={"blend": blend.key})
    return {"losses": losses, "params": full_parameters(engine), "samples": engine.global_samples}


def test_resume_across_a_blend_at_dp2_with_dropout_is_exact(pools, tmp_path):
    first = write_token_dataset(str(tmp_path / "a"))
    original = IndexedDataset(first)
    second = str(tmp_path / "b")  # other tokens: the blend's two sources differ
    write_indexed_dataset(second, [(original[i][::-1].astype(np.int64) + 7) % 251 for i in range(len(original))][::-1],
                          np.uint16)
    save_dir = str(tmp_path / "ckpt")
    straight = pools(2).run(train_blend, [first, second], 4, save_dir, 2, False)
    resumed = pools(2).run(train_blend, [first, second], 4, save_dir, None, True)
    assert straight[0]["samples"] == 4 * 4 > 10  # past the blend's first block
    for full, cont in zip(straight, resumed):
        assert cont["losses"] == full["losses"][2:]
        assert all(torch.equal(cont["params"][name], p) for name, p in full["params"].items())
