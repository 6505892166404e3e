"""The recipe's MoE GPT (configs/gpt2_moe_cpu.json: 4 experts, top-2, dropless) at EP=2 on DP=2
next to the dense GPT with the same active parameters (gpt2_cpu.json with an MLP twice as wide as
one expert: a token passes through 2 experts), in one run on 2 gloo ranks (one thread each):

1. tokens/s: both engines live in the same two processes and take turns (alternating trials), so
   machine noise hits both alike; the ratio is the median of per-trial ratios.
2. validation loss at equal training time: fresh engines from the same seed train in turns, one
   step each, until each has spent --train-seconds of its own step time; then both are evaluated
   on the same validation batches (the MoE loss without its auxiliary losses).
3. time in the MoE layers' all-to-alls as a share of the step, from the timer in
   megazero/moe/comm.py (on only for the MoE's timed steps of part 1): dispatch and combine, each
   forward plus backward, per rank. On gloo the exchange is synchronous, so this time includes
   waiting for the other rank to arrive (its share of any imbalance between the ranks).

fp32, AdamW (the recipe's), global batch 8 x 256 tokens, ZeRO 1 (the experts' data-parallel state
over the expert-data-parallel group; ZeRO 1-3 and offload side by side: bench_moe_zero.py). Writes
benchmarks/results/moe.json. `--quick`: a tiny shape and a few seconds of training, to check that
it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import megazero
from benchmarks.bench_zero import param_groups, recipe_config, spawn_workers
from benchmarks.record import write_result
from megazero import parallel_state
from megazero.data import GPTDataset, IndexedDataset
from megazero.moe.comm import ALL_TO_ALL_TIMER
from megazero.training import evaluate
from models.common import count_active_parameters, count_parameters
from models.gpt import GPT, GPTConfig
from models.parallelize import parallelize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ("moe_ep2", "dense")  # the MoE GPT at EP=2 on DP=2; the dense GPT of its active parameters at DP=2
GLOBAL_BATCH, MICRO_BATCH = 8, 4
EXCHANGES = ("dispatch", "combine")
QUICK = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "seq_length": 64}


def model_config(run: str, quick: bool) -> GPTConfig:
    """The recipe's MoE GPT, or for "dense" gpt2_cpu.json with ffn = topk x the expert's ffn."""
    shape = QUICK if quick else {}
    moe = GPTConfig.from_json(os.path.join(REPO, "configs", "gpt2_moe_cpu.json"), vocab_size=8000, **shape)
    if run == "moe_ep2":
        return moe
    dense = GPTConfig.from_json(os.path.join(REPO, "configs", "gpt2_cpu.json"), vocab_size=8000,
                                ffn_hidden_size=moe.moe_router_topk * moe.ffn_hidden_size, **shape)
    if (dense.num_layers, dense.hidden_size, dense.seq_length) != (moe.num_layers, moe.hidden_size, moe.seq_length):
        raise ValueError("configs/gpt2_cpu.json and gpt2_moe_cpu.json differ in shape: the comparison needs the "
                         "same layers, hidden size and sequence length")
    return dense


class Run:
    """One model's engine (built from seed 0) and an endless iterator over its training batches."""

    def __init__(self, run: str, args):
        config = model_config(run, args.quick)
        grid = parallel_state.initialize_model_parallel(1, 1, 2 if run == "moe_ep2" else 1)
        megazero.set_seed(0)
        model = parallelize(config, grid)
        with open(os.path.join(REPO, "configs", "ds_gpt2_cpu.json")) as f:  # recipe_config() leaves it out
            optimizer = json.load(f)["optimizer"]
        engine_config = {**recipe_config(), "optimizer": optimizer, "train_batch_size": GLOBAL_BATCH,
                         "train_micro_batch_size_per_gpu": MICRO_BATCH,
                         "zero_optimization": {**recipe_config()["zero_optimization"], "stage": 1}}
        dataset = GPTDataset(IndexedDataset(args.data_path + "_train_text_document"), config.seq_length, seed=1)
        self.engine, _, loader, _ = megazero.initialize(model=model, model_parameters=param_groups(model),
                                                        training_data=dataset, config=engine_config,
                                                        mpu=parallel_state)
        self.data = iter(loader)
        self.config = config

    def step(self) -> float:
        return self.engine.train_batch(self.data).item()


def throughput(args) -> dict:
    """Part 1 on this rank: per-trial seconds of each run, the MoE's all-to-all seconds per trial."""
    runs = {name: Run(name, args) for name in RUNS}
    for run in runs.values():
        for _ in range(args.warmup):
            run.step()
    times = {name: [] for name in runs}
    exchange = {name: [] for name in EXCHANGES}
    for _ in range(args.trials):
        for name, run in runs.items():
            ALL_TO_ALL_TIMER.reset()
            ALL_TO_ALL_TIMER.enabled = name == "moe_ep2"
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                run.step()
            times[name].append(time.perf_counter() - start)
            ALL_TO_ALL_TIMER.enabled = False
            if name == "moe_ep2":
                for kind in EXCHANGES:
                    exchange[kind].append(ALL_TO_ALL_TIMER.seconds.get(kind, 0.0) +
                                          ALL_TO_ALL_TIMER.seconds.get(kind + "_backward", 0.0))
    configs = {name: run.config for name, run in runs.items()}
    return {"times": times, "exchange": exchange, "configs": configs}


def equal_time(args, valid_prefix: str) -> dict:
    """Part 2 on this rank: fresh engines train in turns until each has spent args.train_seconds (the
    slower rank's clock decides, so both ranks stop at the same step); then the validation loss."""
    runs = {name: Run(name, args) for name in RUNS}
    spent = {name: 0.0 for name in runs}
    steps = {name: 0 for name in runs}
    while True:
        active = [name for name in runs if spent[name] < args.train_seconds]
        if not active:
            break
        for name in active:
            dist.barrier()
            start = time.perf_counter()
            runs[name].step()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            spent[name] += float(elapsed)
            steps[name] += 1
    losses = {}
    for name, run in runs.items():
        valid = GPTDataset(IndexedDataset(valid_prefix), run.config.seq_length, seed=1)
        losses[name] = evaluate(run.engine, valid, args.eval_iters)["loss"]
    return {"spent": spent, "steps": steps, "valid_loss": losses}


def worker(rank: int, world: int, port: int, args, queue) -> None:
    from benchmarks.bench_zero import init_process

    init_process(rank, world, port)
    part1 = throughput(args)
    part2 = equal_time(args, args.data_path + "_valid_text_document")
    gathered = [None] * world
    dist.all_gather_object(gathered, part1["exchange"])
    if rank == 0:
        queue.put({**part1, **part2, "exchange_per_rank": gathered})
    dist.destroy_process_group()


def summarize(result: dict, args) -> dict:
    """The JSON's rows from rank 0's times and every rank's all-to-all seconds."""
    configs = result["configs"]
    tokens = args.steps * GLOBAL_BATCH * configs["moe_ep2"].seq_length
    rows = {}
    for name in RUNS:
        per_trial = [tokens / t for t in result["times"][name]]
        config = configs[name]
        rows[name] = {
            "tokens_per_s": statistics.median(per_trial), "trials": per_trial,
            "ratio_to_dense": statistics.median(d / t for d, t in zip(result["times"]["dense"],
                                                                       result["times"][name])),
            "parameters": count_parameters(GPT, config), "active_parameters": count_active_parameters(GPT, config),
            "ffn_hidden_size": config.ffn_hidden_size, "num_experts": config.num_experts,
            "train_seconds": result["spent"][name], "train_steps": result["steps"][name],
            "train_tokens": result["steps"][name] * GLOBAL_BATCH * config.seq_length,
            # the same comparison over part 2's alternating single steps (more of them than part 1's trials)
            "equal_time_tokens_per_s": result["steps"][name] * GLOBAL_BATCH * config.seq_length / result["spent"][name],
            "valid_loss": result["valid_loss"][name],
        }
    moe_time = sum(result["times"]["moe_ep2"])
    rows["moe_ep2"]["all_to_all_share"] = {
        kind: [sum(rank[kind]) / moe_time for rank in result["exchange_per_rank"]] for kind in EXCHANGES}
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", default=os.path.join(REPO, "data", "gpt2", "shakespeare"))
    parser.add_argument("--steps", type=int, default=2, help="steps per trial")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--train-seconds", type=float, default=90.0, help="part 2: training time of each model")
    parser.add_argument("--eval-iters", type=int, default=8, help="part 2: validation micro-batches per rank")
    parser.add_argument("--quick", action="store_true", help="a tiny shape, 1 trial, 3 s of training")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "moe.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.trials, args.warmup, args.train_seconds, args.eval_iters = 1, 2, 1, 3.0, 2
    torch.set_num_threads(1)
    result = spawn_workers(worker, (args,))[0]
    rows = summarize(result, args)
    moe, dense = rows["moe_ep2"], rows["dense"]
    config = result["configs"]["moe_ep2"]
    print(f"recipe MoE GPT (gpt2_moe_cpu.json{', --quick shape' if args.quick else ''}: {config.num_experts} experts, "
          f"top-{config.moe_router_topk}, dropless) at EP=2 on DP=2 vs the dense GPT of the same active parameters "
          f"(ffn {dense['ffn_hidden_size']} = {config.moe_router_topk} x {config.ffn_hidden_size}); 2 gloo ranks x 1 "
          f"thread, fp32, ZeRO 1, {GLOBAL_BATCH} x {config.seq_length} tokens/step, {args.trials} alternating trials "
          f"of {args.steps} steps")
    print(f"{'model':<10}{'params':>12}{'active':>12}{'tokens/s':>10}{'vs dense':>10}{'steps in':>10}"
          f"{'tokens/s':>10}{'valid loss':>12}")
    for name, row in rows.items():
        print(f"{name:<10}{row['parameters']:>12,}{row['active_parameters']:>12,}{row['tokens_per_s']:>10,.0f}"
              f"{row['ratio_to_dense']:>10.3f}{row['train_steps']:>10}{row['equal_time_tokens_per_s']:>10,.0f}"
              f"{row['valid_loss']:>12.4f}")
    print(f"steps in: training steps done in {args.train_seconds:.0f} s of each model's own step time (alternating "
          f"steps), and their tokens/s; valid loss: mean over {args.eval_iters} x 2 validation micro-batches of "
          f"{MICRO_BATCH}, the same for both")
    for kind, shares in moe["all_to_all_share"].items():
        print(f"all-to-all {kind} (forward + backward) share of the MoE step, per rank: "
              + " ".join(f"{s:.3f}" for s in shares))
    write_result("moe", {"quick": args.quick, "train_seconds": args.train_seconds, "rows": rows}, args=args,
                 argv=argv, out=args.out)
    return rows


if __name__ == "__main__":
    main()
