"""Pretrain a GPT with the megazero engine (Megatron-style flags plus an engine JSON config).

Launch with torchrun (or srun/mpirun); a plain `python` run is world size 1. Resumes from --load
when it holds a checkpoint. See scripts/pretrain_gpt2.sh for the `make pretrain-gpt2` recipe.
The flags, the loop and its log lines are megazero/training.py's; this file is the GPT (flags,
model, data, train): copy it and change the model to pretrain another.
"""

from __future__ import annotations

import os

from megazero import training
from megazero.causal_lm_recipe import causal_lm_run
from megazero.profiling import gpt_flops_per_token
from models.common import count_active_parameters, count_parameters
from models.gpt import GPT, GPTConfig
from models.parallelize import parallelize

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def parse_args(argv=None):
    """The shared recipe flags (defaults: the CPU GPT-2 configs) and the end-of-run sample's."""
    p = training.recipe_parser(__doc__, model_config=os.path.join(CONFIGS, "gpt2_cpu.json"),
                               engine_config_path=os.path.join(CONFIGS, "ds_gpt2_cpu.json"))
    training.add_moe_arguments(p)
    training.add_sampling_arguments(p)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    rank, grid, tokenizer = training.start_run(args)

    # the model: --model-config with the size, recompute, parallelism and MoE flags; this rank's part of it
    config = GPTConfig.from_json(args.model_config, vocab_size=tokenizer.vocab_size, **training.model_overrides(args),
                                 **training.moe_overrides(args))
    model = parallelize(config, grid, args.num_layers_per_virtual_pipeline_stage, training.partition_method(args),
                        num_microbatches=training.microbatches_per_step(args))
    args.seq_length = config.seq_length
    num_params = count_parameters(GPT, config.single_process())  # the same at every layout
    active = count_active_parameters(GPT, config.single_process())  # MoE: the experts a token visits
    flops = gpt_flops_per_token(active, config.num_layers, config.hidden_size, args.seq_length)

    # the data (--data-path: one prefix, or weights and prefixes to blend), validation and the end of the run
    run = causal_lm_run(args, model, tokenizer, grid, rank)

    return training.train(args, model, run.data.train, grid=grid, name="GPT", num_params=num_params,
                          flops_per_token=flops, validate=run.validate, finish=run.finish, active_params=active,
                          details=lambda peak: f"peak {peak / 1e9:.1f} GFLOP/s per rank")


if __name__ == "__main__":
    main()
