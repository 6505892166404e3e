"""What the causal language-model recipes (scripts/pretrain_gpt.py, pretrain_llama.py) share beyond
megazero.training: their data (GPT samples of --data-path, one prefix or a weighted blend, every id
checked against the tokenizer before any step), the validation they run and how a run ends
(a last validation, the test split, a sample)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megazero import training
from megazero.data import GPTDataset
from megazero.data.tokenizer import SentencePieceTokenizer
from megazero.data.vocab_check import check_token_ids


@dataclass
class CausalLMRun:
    """The datasets of one run, and the validate/finish callbacks megazero.training.train takes."""

    data: object  # training.build_datasets' result: .train, .valid/.test by name and their weights
    unigram: float | None  # unigram entropy (nats) of the one validation set, which losses are compared with
    validate: Callable
    finish: Callable


def causal_lm_run(args: argparse.Namespace, model: torch.nn.Module, tokenizer: SentencePieceTokenizer,
                  grid, rank: int) -> CausalLMRun:
    """GPT datasets of --data-path cut into train/valid(/test) and the recipe's validate/finish."""
    def make(indexed, split: str) -> GPTDataset:
        check_token_ids(indexed, tokenizer.vocab_size, args.tokenizer_model)
        return GPTDataset(indexed, args.seq_length, seed=args.seed, shuffle=split == "train")

    data = training.build_datasets(args, make)
    stats_path = training.first_prefix(args) + "_stats.json"
    unigram = json.load(open(stats_path)).get("unigram_entropy_nats") \
        if os.path.exists(stats_path) and len(data.valid) == 1 else None

    def validate(engine) -> float | None:
        return training.run_evaluation(engine, data.valid, args, rank, unigram, data.valid_weights) \
            if data.valid else None

    def finish(engine, val_loss: float | None, reason: str | None) -> dict:
        """A last validation when none ran, then the test split and a sample (none after a preemption signal)."""
        if reason != "signal":
            if val_loss is None:
                val_loss = validate(engine)
            if data.test:
                training.run_evaluation(engine, data.test, args, rank, None, data.test_weights, label="test")
            training.print_sample(model, tokenizer, args, grid, rank,
                                  partitioned=engine.config.zero_optimization.stage == 3)
        return {"iteration": engine.global_steps, "val_loss": val_loss, "unigram_entropy": unigram}

    return CausalLMRun(data, unigram, validate, finish)
