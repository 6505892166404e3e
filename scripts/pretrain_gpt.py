"""Pretrain a GPT with the megazero engine (Megatron-style flags plus an engine JSON config).

Launch with torchrun (or srun/mpirun); a plain `python` run is world size 1. Resumes from --load
when it holds a checkpoint. See scripts/pretrain_gpt2.sh for the `make pretrain-gpt2` recipe.
The flags, the loop and its log lines are megazero/training.py's; this file is the GPT (flags,
model, data, train): copy it and change the model to pretrain another.
"""

from __future__ import annotations

import json
import os

from megazero import training
from megazero.data import GPTDataset
from megazero.data.vocab_check import check_token_ids
from megazero.profiling import gpt_flops_per_token
from models.common import count_parameters
from models.gpt import GPT, GPTConfig
from models.parallelize import parallelize

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def parse_args(argv=None):
    """The shared recipe flags (defaults: the CPU GPT-2 configs) and the end-of-run sample's."""
    p = training.recipe_parser(__doc__, model_config=os.path.join(CONFIGS, "gpt2_cpu.json"),
                               engine_config_path=os.path.join(CONFIGS, "ds_gpt2_cpu.json"))
    training.add_sampling_arguments(p)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    rank, grid, tokenizer = training.start_run(args)

    # the model: --model-config with the size, recompute and parallelism flags; this rank's part of it
    config = GPTConfig.from_json(args.model_config, vocab_size=tokenizer.vocab_size, **training.model_overrides(args))
    model = parallelize(config, grid)
    args.seq_length = config.seq_length
    num_params = count_parameters(GPT, config.single_process())  # the same at every layout
    flops = gpt_flops_per_token(num_params, config.num_layers, config.hidden_size, args.seq_length)

    # the data: --data-path (one prefix, or weights and prefixes to blend) cut into train/valid(/test),
    # every id checked against the tokenizer's vocabulary before any step; the unigram entropy
    # validation is compared with (one dataset)
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
        """A last validation when none ran, then a sample (neither after a preemption signal)."""
        if reason != "signal":
            if val_loss is None:
                val_loss = validate(engine)
            if data.test:
                training.run_evaluation(engine, data.test, args, rank, None, data.test_weights, label="test")
            training.print_sample(model, tokenizer, args, grid, rank)
        return {"iteration": engine.global_steps, "val_loss": val_loss, "unigram_entropy": unigram}

    return training.train(args, model, data.train, grid=grid, name="GPT", num_params=num_params,
                          flops_per_token=flops, validate=validate, finish=finish,
                          details=lambda peak: f"peak {peak / 1e9:.1f} GFLOP/s per rank")


if __name__ == "__main__":
    main()
