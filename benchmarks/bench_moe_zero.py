"""The recipe's MoE GPT (configs/gpt2_moe_cpu.json: 4 experts, top-2, dropless) at EP=2 on DP=4 (4
gloo ranks, one thread each: each expert held by 2 ranks, its expert-data-parallel group) under
ZeRO 1, 2 and 3, and ZeRO-3 with optimizer and parameter offload to nvme, side by side:

1. model-state bytes per rank (parameters + gradients + optimizer states, `engine.memory_report()`
   after the warm-up steps; with offload, what is in memory);
2. seconds per step: every configuration lives in the same four processes and they take turns
   (alternating trials), so machine noise hits all alike; the ratio to ZeRO-1 is the median of
   per-trial ratios;
3. the losses of every step, which must agree across the configurations (same seed and batches).

fp32, the recipe's AdamW, global batch 8 x 256 tokens (micro-batch 2). Writes
benchmarks/results/moe_zero.json. `--quick`: a tiny shape, to check that it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import megazero
from benchmarks.bench_zero import init_process, param_groups, recipe_config, spawn_workers
from benchmarks.record import write_result
from megazero import parallel_state
from megazero.data import GPTDataset, IndexedDataset
from models.common import count_parameters
from models.gpt import GPT, GPTConfig
from models.parallelize import parallelize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD, EP, GLOBAL_BATCH, MICRO_BATCH = 4, 2, 8, 2
RUNS = ("zero1", "zero2", "zero3", "zero3_nvme")
QUICK = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "seq_length": 64}
NOTE = ("with offload, the tensors held after the step: the parameter swap's buffer pool (5 x 1.2 M elements, "
        "24 MB, allocated once) is not counted")


def zero_block(run: str, nvme_path: str) -> dict:
    """The recipe's zero_optimization at the run's stage (zero3_nvme: both offloads under nvme_path)."""
    zero = {**recipe_config()["zero_optimization"], "stage": int(run[4])}
    if run == "zero3_nvme":  # sub-groups of 2M elements, 2 in memory at a time; no partition cached
        zero.update(offload_optimizer={"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2},
                    offload_param={"device": "nvme", "nvme_path": nvme_path, "buffer_count": 5,
                                   "buffer_size": 1_200_000, "max_in_cpu": 0}, sub_group_size=2_000_000)
    return zero


class Run:
    """One configuration's engine (built from seed 0) and an endless iterator over its batches."""

    def __init__(self, run: str, args, nvme_path: str):
        self.config = GPTConfig.from_json(os.path.join(REPO, "configs", "gpt2_moe_cpu.json"), vocab_size=8000,
                                          **(QUICK if args.quick else {}))
        grid = parallel_state.initialize_model_parallel(1, 1, EP)
        megazero.set_seed(0)
        model = parallelize(self.config, grid)
        with open(os.path.join(REPO, "configs", "ds_gpt2_cpu.json")) as f:  # recipe_config() leaves it out
            optimizer = json.load(f)["optimizer"]
        engine_config = {**recipe_config(), "optimizer": optimizer, "train_batch_size": GLOBAL_BATCH,
                         "train_micro_batch_size_per_gpu": MICRO_BATCH, "zero_optimization": zero_block(run, nvme_path)}
        dataset = GPTDataset(IndexedDataset(args.data_path + "_train_text_document"), self.config.seq_length, seed=1)
        self.engine, _, loader, _ = megazero.initialize(model=model, model_parameters=param_groups(model),
                                                        training_data=dataset, config=engine_config,
                                                        mpu=parallel_state)
        self.data = iter(loader)
        self.losses: list[float] = []

    def step(self) -> None:
        loss = self.engine.train_batch(self.data).detach()
        dist.all_reduce(loss, group=self.engine.dp_group)
        self.losses.append(loss.item() / self.engine.dp_world_size)

    def memory(self) -> dict[str, int]:
        """This rank's model-state bytes, by kind."""
        report = self.engine.memory_report()
        return {k: report[k] for k in ("parameters", "gradients", "optimizer_states", "total")}


def worker(rank: int, world: int, port: int, args, queue) -> None:
    init_process(rank, world, port)
    with tempfile.TemporaryDirectory(prefix="megazero-bench-moe-zero-") as nvme:
        runs = {name: Run(name, args, nvme) for name in RUNS}
        for run in runs.values():
            for _ in range(args.warmup):
                run.step()
        memory = {name: run.memory() for name, run in runs.items()}
        times = {name: [] for name in runs}
        for _ in range(args.trials):
            for name, run in runs.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.steps):
                    run.step()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
                times[name].append(float(elapsed) / args.steps)
        gathered = [None] * world
        dist.all_gather_object(gathered, memory)
        if rank == 0:
            queue.put({"times": times, "memory_per_rank": gathered, "config": runs["zero1"].config,
                       "losses": {name: run.losses for name, run in runs.items()}})
        del runs
    dist.destroy_process_group()


def expert_elements(config: GPTConfig) -> tuple[int, int]:
    """(dense, expert) parameter elements of the whole model."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(config)
    expert = sum(p.numel() for p in model.parameters() if getattr(p, "megazero_expert", False))
    return count_parameters(GPT, config) - expert, expert


def summarize(result: dict) -> dict:
    """The JSON's rows: rank 0's seconds per step (and ratio to ZeRO-1), the largest model state of any
    rank, and the losses."""
    rows = {}
    for name in RUNS:
        per_rank = [m[name] for m in result["memory_per_rank"]]
        rows[name] = {
            "seconds_per_step": statistics.median(result["times"][name]), "trials": result["times"][name],
            "time_vs_zero1": statistics.median(t / z for t, z in zip(result["times"][name], result["times"]["zero1"])),
            **{f"{kind}_bytes": max(m[kind] for m in per_rank) for kind in per_rank[0]},
            "memory_vs_zero1": max(m["total"] for m in per_rank) / max(m["zero1"]["total"]
                                                                         for m in result["memory_per_rank"]),
            "losses": result["losses"][name],
            "max_loss_difference_to_zero1": max(abs(a - b) for a, b in zip(result["losses"][name],
                                                                             result["losses"]["zero1"])),
        }
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", default=os.path.join(REPO, "data", "gpt2", "shakespeare"))
    parser.add_argument("--steps", type=int, default=2, help="steps per trial")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a tiny shape, 1 trial of 1 step")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "moe_zero.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.trials, args.warmup = 1, 1, 1
    torch.set_num_threads(1)
    result = spawn_workers(worker, (args,), world=WORLD)[0]
    rows = summarize(result)
    config = result["config"]
    dense, expert = expert_elements(config)
    print(f"recipe MoE GPT (gpt2_moe_cpu.json{', --quick shape' if args.quick else ''}: {config.num_experts} experts, "
          f"top-{config.moe_router_topk}; {dense:,} dense and {expert:,} expert parameters) at EP={EP} on DP={WORLD} "
          f"(expert-DP {WORLD // EP}); {WORLD} gloo ranks x 1 thread, fp32, {GLOBAL_BATCH} x {config.seq_length} "
          f"tokens/step, {args.trials} alternating trials of {args.steps} steps")
    print(f"{'config':<12}{'s/step':>9}{'vs ZeRO-1':>11}{'params MB':>11}{'grads MB':>10}{'optim MB':>10}"
          f"{'total MB':>10}{'vs ZeRO-1':>11}{'max |loss diff|':>17}")
    for name, row in rows.items():
        print(f"{name:<12}{row['seconds_per_step']:>9.3f}{row['time_vs_zero1']:>11.3f}"
              f"{row['parameters_bytes'] / 1e6:>11.1f}{row['gradients_bytes'] / 1e6:>10.1f}"
              f"{row['optimizer_states_bytes'] / 1e6:>10.1f}{row['total_bytes'] / 1e6:>10.1f}"
              f"{row['memory_vs_zero1']:>11.3f}{row['max_loss_difference_to_zero1']:>17.2e}")
    print(f"bytes: the largest of any rank, after the warm-up step; {NOTE}")
    write_result("moe_zero", {"quick": args.quick, "dense_parameters": dense, "expert_parameters": expert,
                              "world": WORLD, "ep": EP, "note": NOTE, "rows": rows}, args=args, argv=argv, out=args.out)
    return rows


if __name__ == "__main__":
    main()
