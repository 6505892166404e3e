"""Per-rank memory of model states for each ZeRO stage, for a model config and a number of ranks.

    python scripts/estimate_memory.py --model-config configs/gpt2_1.5b.json --num-ranks 64
    python scripts/estimate_memory.py --model-config configs/llama_7b.json --num-ranks 64
    python scripts/estimate_memory.py --num-ranks 2 --offload-optimizer nvme --sub-group-size 100000000
    python scripts/estimate_memory.py --num-ranks 2 --offload-optimizer nvme --offload-param nvme --max-in-cpu 0

The model family is the one whose config has every key of the JSON (GPT-2's first; a Llama
config names num_query_groups). With --offload-optimizer nvme, stages 1-3 keep the masters and
optimizer states on disk (the "disk GiB" column) and only the sub-group buffers in memory; stages
2-3 the reduced gradients too (memory: the step's read and backward's write buffers). With
--offload-param nvme (stage 3 only) the partitioned parameters are on disk too, and memory keeps
the persistent parameters (--persistent-params elements, 0 if not given) and at most --max-in-cpu
cached partition elements. Context parallelism changes no model state: its ranks join the
data-parallel group ZeRO partitions over (--num-ranks DP x CP); it divides the activations, which
this estimate leaves out, by CP.
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
    parser.add_argument("--num-ranks", type=int, default=64,
                        help="the data-parallel ranks ZeRO partitions over: DP, or DP x CP with context parallelism "
                             "(a model replica's context-parallel ranks share its states' partitions)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    parser.add_argument("--optimizer", default="adam", help="adam, adamw, lamb, sgd")
    parser.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default="none",
                        help="zero_optimization.offload_optimizer.device")
    parser.add_argument("--sub-group-size", type=int, default=1_000_000_000, help="zero_optimization.sub_group_size")
    parser.add_argument("--buffer-count", type=int, default=4, help="offload_optimizer.buffer_count")
    parser.add_argument("--reduce-bucket-size", type=int, default=500_000_000,
                        help="zero_optimization.reduce_bucket_size")
    parser.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default="none",
                        help="zero_optimization.offload_param.device (stage 3)")
    parser.add_argument("--max-in-cpu", type=int, default=1_000_000_000, help="offload_param.max_in_cpu")
    parser.add_argument("--persistent-params", type=int, default=0,
                        help="elements of the parameters under stage3_param_persistence_threshold")
    args = parser.parse_args(argv)
    params_swapped = args.offload_param == "nvme"
    offload = args.offload_optimizer == "nvme" or params_swapped
    psi = args.num_params or _count(args.model_config)
    gib = 2 ** 30
    print(f"{psi / 1e6:,.1f} M parameters, {args.num_ranks} data-parallel ranks, {args.precision}, {args.optimizer}")
    if offload:
        if args.offload_optimizer == "nvme":
            print(f"optimizer offload to nvme: sub_group_size {args.sub_group_size:,}, "
                  f"buffer_count {args.buffer_count}")
        if params_swapped:
            print(f"parameter offload to nvme: max_in_cpu {args.max_in_cpu:,}, "
                  f"{args.persistent_params:,} persistent parameters")
    disk_head = f"{'disk GiB':>12}" if offload else ""
    print(f"{'stage':<7}{'parameters':>12}{'gradients':>12}{'optimizer':>12}{'total GiB':>12}{'ZeRO paper':>12}"
          + disk_head)
    first = 3 if params_swapped else 1 if offload else 0
    for stage in range(first, 4):
        e = estimate_zero_memory(psi, args.num_ranks, stage, args.precision, args.optimizer,
                                 args.offload_optimizer, args.sub_group_size, args.buffer_count,
                                 args.reduce_bucket_size, args.offload_param, args.max_in_cpu,
                                 args.persistent_params)
        paper = paper_zero_memory(psi, args.num_ranks, stage) / gib if args.precision != "fp32" else float("nan")
        disk = f"{e['disk'] / gib:>12.2f}" if offload else ""
        print(f"{stage:<7}{e['parameters'] / gib:>12.2f}{e['gradients'] / gib:>12.2f}"
              f"{e['optimizer_states'] / gib:>12.2f}{e['total'] / gib:>12.2f}{paper:>12.2f}{disk}")
    print("per rank, model states only (activations and communication buckets come on top)")
    for note in _offload_notes(args, psi):
        print("note: " + note)


def _offload_notes(args: argparse.Namespace, psi: int) -> list[str]:
    """Where the optimizer offload's settings leave its memory unbounded by the sub-group."""
    if args.offload_optimizer != "nvme":
        return []
    partition = -(-psi // args.num_ranks)
    chunk = -(-args.reduce_bucket_size // args.num_ranks)  # a sub-group is whole master chunks
    if args.sub_group_size >= partition:
        return [f"sub_group_size {args.sub_group_size:,} >= a rank's partition ({partition:,} elements): the "
                f"optimizer steps it as one sub-group, its whole state in memory during the step; a smaller "
                f"--sub-group-size (zero_optimization.sub_group_size) bounds it"]
    if args.sub_group_size < chunk:
        return [f"sub_group_size {args.sub_group_size:,} is below a master chunk ({chunk:,} elements: "
                f"reduce_bucket_size / ranks), which is never split: each sub-group is one chunk; a smaller "
                f"--reduce-bucket-size makes them smaller"]
    return []


if __name__ == "__main__":
    main()
