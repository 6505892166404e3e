"""Pretrain a Llama (models/llama.py) with the megazero engine: pretrain_gpt.py's flags and loop,
plus Megatron's Llama flags --num-query-groups, --rope-theta, --ffn-hidden-size and
--untie-embeddings-and-output-weights.

Untied embeddings are this recipe's default (configs/llama_cpu.json), so
--untie-embeddings-and-output-weights is accepted for Megatron command lines and changes nothing
there; --tie-embeddings-and-output-weights makes the output layer the word embedding (Megatron's
own default). See scripts/pretrain_llama.sh for `make pretrain-llama`.
"""

from __future__ import annotations

import os

from megazero import training
from megazero.causal_lm_recipe import causal_lm_run
from megazero.profiling import gpt_flops_per_token
from models.common import count_active_parameters, count_parameters
from models.llama import Llama, LlamaConfig
from models.parallelize import parallelize

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def parse_args(argv=None):
    """The shared recipe flags (defaults: the CPU Llama config), the Llama flags and the sample's."""
    p = training.recipe_parser(__doc__, model_config=os.path.join(CONFIGS, "llama_cpu.json"),
                               engine_config_path=os.path.join(CONFIGS, "ds_gpt2_cpu.json"))
    p.add_argument("--num-query-groups", type=int, help="key/value heads (1: multi-query attention)")
    p.add_argument("--rope-theta", type=float, help="base of the rotary embedding's frequencies")
    p.add_argument("--ffn-hidden-size", type=int, help="SwiGLU width")
    tie = p.add_mutually_exclusive_group()
    tie.add_argument("--untie-embeddings-and-output-weights", dest="untie", action="store_const", const=True,
                     help="an output layer of its own (this recipe's default)")
    tie.add_argument("--tie-embeddings-and-output-weights", dest="untie", action="store_const", const=False,
                     help="the output layer is the word embedding")
    training.add_moe_arguments(p)
    training.add_sampling_arguments(p)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    rank, grid, tokenizer = training.start_run(args)

    # the model: --model-config with the size, Llama, recompute, parallelism and MoE flags; this rank's part
    overrides = {**training.model_overrides(args), **training.moe_overrides(args),
                 "num_query_groups": args.num_query_groups, "rope_theta": args.rope_theta,
                 "ffn_hidden_size": args.ffn_hidden_size, "untie_embeddings_and_output_weights": args.untie}
    config = LlamaConfig.from_json(args.model_config, vocab_size=tokenizer.vocab_size, **overrides)
    model = parallelize(config, grid, args.num_layers_per_virtual_pipeline_stage, training.partition_method(args),
                        num_microbatches=training.microbatches_per_step(args))
    args.seq_length = config.seq_length
    num_params = count_parameters(Llama, config.single_process())  # the same at every layout
    active = count_active_parameters(Llama, config.single_process())  # MoE: the experts a token visits
    flops = gpt_flops_per_token(active, config.num_layers, config.hidden_size, args.seq_length)

    # the data (--data-path: one prefix, or weights and prefixes to blend), validation and the end of the run
    run = causal_lm_run(args, model, tokenizer, grid, rank)

    groups = f"{config.num_query_groups} key/value groups for {config.num_attention_heads} heads"
    return training.train(args, model, run.data.train, grid=grid, name="Llama", num_params=num_params,
                          flops_per_token=flops, validate=run.validate, finish=run.finish, active_params=active,
                          details=lambda peak: f"{groups}, peak {peak / 1e9:.1f} GFLOP/s per rank")


if __name__ == "__main__":
    main()
