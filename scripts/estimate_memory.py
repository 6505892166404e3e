"""Per-rank memory of model states for each ZeRO stage, for a model config and a number of ranks.

    python scripts/estimate_memory.py --model-config configs/gpt2_1.5b.json --num-ranks 64
    python scripts/estimate_memory.py --model-config configs/llama_7b.json --num-ranks 64

The model family is the one whose config has every key of the JSON (GPT-2's first; a Llama
config names num_query_groups).
"""

from __future__ import annotations

import argparse
import json
import os

from megazero.profiling import estimate_zero_memory, paper_zero_memory
from models.common import count_parameters
from models.parallelize import config_class_for, model_class

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _count(path: str) -> int:
    """Parameters of the model a config JSON describes (its family from its keys)."""
    with open(path) as f:
        config = config_class_for(json.load(f)).from_json(path)
    return count_parameters(model_class(config), config)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", default=os.path.join(REPO, "configs", "gpt2_1.5b.json"))
    parser.add_argument("--num-params", type=int, default=None, help="instead of --model-config")
    parser.add_argument("--num-ranks", type=int, default=64)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    parser.add_argument("--optimizer", default="adam", help="adam, adamw, lamb, sgd")
    args = parser.parse_args(argv)
    psi = args.num_params or _count(args.model_config)
    gib = 2 ** 30
    print(f"{psi / 1e6:,.1f} M parameters, {args.num_ranks} data-parallel ranks, {args.precision}, {args.optimizer}")
    print(f"{'stage':<7}{'parameters':>12}{'gradients':>12}{'optimizer':>12}{'total GiB':>12}{'ZeRO paper':>12}")
    for stage in range(4):
        e = estimate_zero_memory(psi, args.num_ranks, stage, args.precision, args.optimizer)
        paper = paper_zero_memory(psi, args.num_ranks, stage) / gib if args.precision != "fp32" else float("nan")
        print(f"{stage:<7}{e['parameters'] / gib:>12.2f}{e['gradients'] / gib:>12.2f}"
              f"{e['optimizer_states'] / gib:>12.2f}{e['total'] / gib:>12.2f}{paper:>12.2f}")
    print("per rank, model states only (activations and communication buckets come on top)")


if __name__ == "__main__":
    main()
