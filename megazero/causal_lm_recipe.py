"""What the causal language-model recipes (scripts/pretrain_gpt.py, pretrain_llama.py) share beyond
megazero.training: their data (GPT samples of --data-path, one prefix or a weighted blend, every id
checked against the tokenizer before any step), their validation, and how a run ends (a last
validation, the test split, a sample). Helpers the recipes' loops call."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from megazero import training
from megazero.config.run import RunConfig
from megazero.data import GPTDataset
from megazero.data.data_paths import first_prefix
from megazero.data.tokenizer import Tokenizer
from megazero.data.vocab_check import check_token_ids


@dataclass
class CausalLMData:
    """The datasets of one run (training.build_datasets' splits) and the unigram entropy (nats) of the
    one validation set, which losses are compared with."""

    splits: object  # .train, .valid/.test by name and their weights
    unigram: float | None

    def validate(self, engine, eval_iters: int, rank: int) -> float | None:
        """The validation loss (printed and logged); None without validation data."""
        if not self.splits.valid:
            return None
        return training.run_evaluation(engine, self.splits.valid, eval_iters, rank, self.unigram,
                                       self.splits.valid_weights)


def causal_lm_data(run: RunConfig, tokenizer: Tokenizer) -> CausalLMData:
    """GPT datasets of --data-path cut into train/valid(/test), with the fields of the document flags
    (--reset-position-ids, --reset-attention-mask, --eod-mask-loss) at the tokenizer's eod."""
    packing = run.data.document_packing(tokenizer.eod)

    def make(indexed, split: str) -> GPTDataset:
        check_token_ids(indexed, tokenizer.vocab_size, run.data.tokenizer_spec().describe())
        return GPTDataset(indexed, run.model.seq_length, seed=run.seed, shuffle=split == "train", packing=packing)

    splits = training.build_datasets(run, make)
    stats_path = first_prefix(run.data) + "_stats.json"
    unigram = json.load(open(stats_path)).get("unigram_entropy_nats") \
        if os.path.exists(stats_path) and len(splits.valid) == 1 else None
    return CausalLMData(splits, unigram)


def end_of_run(engine, model: torch.nn.Module, data: CausalLMData, run: RunConfig, tokenizer, grid, rank: int,
               val_loss: float | None, reason: str | None) -> dict:
    """A last validation when none ran, then the test split and a sample (none after a preemption
    signal); the run's result."""
    if reason != "signal":
        if val_loss is None:
            val_loss = data.validate(engine, run.schedule.eval_iters, rank)
        if data.splits.test:
            training.run_evaluation(engine, data.splits.test, run.schedule.eval_iters, rank, None,
                                    data.splits.test_weights, label="test")
        training.print_sample(model, tokenizer, run.sample, run.seed, grid, rank,
                              partitioned=engine.config.zero_optimization.stage == 3)
    return {"iteration": engine.global_steps, "val_loss": val_loss, "unigram_entropy": data.unigram}
