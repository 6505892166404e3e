"""Per-rank memory of model states for each ZeRO stage, for a model config and a number of ranks.

    python scripts/estimate_memory.py --model-config configs/gpt2_1.5b.json --num-ranks 64
    python scripts/estimate_memory.py --num-ranks 2 --offload-optimizer nvme --sub-group-size 100000000

With --offload-optimizer nvme, stages 1-3 keep the masters and optimizer states on disk (the
"disk GiB" column) and only the sub-group buffers in memory.
"""

from __future__ import annotations

import argparse
import os

from megazero.profiling import estimate_zero_memory, paper_zero_memory
from models.common import count_parameters
from models.gpt import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", default=os.path.join(REPO, "configs", "gpt2_1.5b.json"))
    parser.add_argument("--num-params", type=int, default=None, help="instead of --model-config")
    parser.add_argument("--num-ranks", type=int, default=64)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    parser.add_argument("--optimizer", default="adam", help="adam, adamw, lamb, sgd")
    parser.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default="none",
                        help="zero_optimization.offload_optimizer.device")
    parser.add_argument("--sub-group-size", type=int, default=1_000_000_000, help="zero_optimization.sub_group_size")
    parser.add_argument("--buffer-count", type=int, default=4, help="offload_optimizer.buffer_count")
    parser.add_argument("--reduce-bucket-size", type=int, default=500_000_000,
                        help="zero_optimization.reduce_bucket_size")
    args = parser.parse_args(argv)
    offload = args.offload_optimizer == "nvme"
    psi = args.num_params or count_parameters(GPT, GPTConfig.from_json(args.model_config))
    gib = 2 ** 30
    print(f"{psi / 1e6:,.1f} M parameters, {args.num_ranks} data-parallel ranks, {args.precision}, {args.optimizer}")
    if offload:
        print(f"optimizer offload to nvme: sub_group_size {args.sub_group_size:,}, buffer_count {args.buffer_count}")
    disk_head = f"{'disk GiB':>12}" if offload else ""
    print(f"{'stage':<7}{'parameters':>12}{'gradients':>12}{'optimizer':>12}{'total GiB':>12}{'ZeRO paper':>12}"
          + disk_head)
    for stage in range(1 if offload else 0, 4):
        e = estimate_zero_memory(psi, args.num_ranks, stage, args.precision, args.optimizer,
                                 args.offload_optimizer, args.sub_group_size, args.buffer_count,
                                 args.reduce_bucket_size)
        paper = paper_zero_memory(psi, args.num_ranks, stage) / gib if args.precision != "fp32" else float("nan")
        disk = f"{e['disk'] / gib:>12.2f}" if offload else ""
        print(f"{stage:<7}{e['parameters'] / gib:>12.2f}{e['gradients'] / gib:>12.2f}"
              f"{e['optimizer_states'] / gib:>12.2f}{e['total'] / gib:>12.2f}{paper:>12.2f}{disk}")
    print("per rank, model states only (activations and communication buckets come on top)")


if __name__ == "__main__":
    main()
