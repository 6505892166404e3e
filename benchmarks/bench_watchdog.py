"""The hung-rank watchdog's cost: the recipe's GPT trained with the watchdog off and on, side by side.

Two gloo ranks (one thread each), the recipe's model and engine config (gpt2_cpu.json,
ds_gpt2_cpu.json: fp32, clipping) at ZeRO stages 0 and 2, the real corpus. In one run the
watchdog is switched off and on between trials (alternating, so machine noise hits both alike),
with its heartbeat every second (timeout 10 s, the shortest interval a recipe would get below the
default's 5 s). Reported per stage: tokens/s off and on, the median on/off ratio of paired trials,
the marked operations per step, and the cost of one mark (begin + end) timed alone, which bounds
what the hot path adds per step. Writes benchmarks/results/watchdog.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import megazero
from benchmarks.bench_zero import param_groups, recipe_config, spawn_workers
from benchmarks.record import write_result
from megazero import watchdog
from megazero.config import WatchdogConfig
from megazero.data import GPTDataset, IndexedDataset
from models.gpt import GPTConfig
from models.parallelize import parallelize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STAGES = (0, 2)
TIMEOUT = 10.0


def mark_cost(repeats: int = 200_000) -> float:
    """Seconds per begin() + end() of the running watchdog, the only work it adds to the main thread."""
    dog = watchdog.active()
    start = time.perf_counter()
    for _ in range(repeats):
        dog.end(dog.begin("bench"))
    return (time.perf_counter() - start) / repeats


def worker(rank: int, world: int, port: int, args, queue) -> None:
    from benchmarks.bench_zero import init_process

    init_process(rank, world, port)
    model_config = GPTConfig.from_json(os.path.join(REPO, "configs", "gpt2_cpu.json"), vocab_size=8000)
    dataset = GPTDataset(IndexedDataset(args.data_path + "_train_text_document"), model_config.seq_length, seed=1)
    runs = {}
    for stage in STAGES:
        megazero.set_seed(0)
        model = parallelize(model_config)
        config = recipe_config()
        config["zero_optimization"] = {**config["zero_optimization"], "stage": stage}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}
        engine, _, loader, _ = megazero.initialize(model=model, model_parameters=param_groups(model),
                                                   training_data=dataset, config=config)
        runs[stage] = (engine, iter(loader))
    times = {stage: {"off": [], "on": []} for stage in STAGES}
    ops = {}
    for trial in range(args.warmup + args.trials):
        for stage, (engine, data) in runs.items():
            for mode in ("off", "on") if trial % 2 == 0 else ("on", "off"):
                dog = watchdog.configure_watchdog(WatchdogConfig(enabled=mode == "on", timeout=TIMEOUT), engine)
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.steps):
                    engine.train_batch(data)
                took = time.perf_counter() - start
                if trial >= args.warmup:
                    times[stage][mode].append(took)
                if dog is not None:
                    ops[stage] = dog.completed / args.steps
    watchdog.configure_watchdog(WatchdogConfig(enabled=True, timeout=TIMEOUT))
    cost = mark_cost()
    watchdog.configure_watchdog(WatchdogConfig(enabled=False))
    if rank == 0:
        queue.put({"times": times, "ops_per_step": ops, "mark_s": cost,
                   "tokens_per_step": runs[STAGES[0]][0].train_batch_size() * model_config.seq_length})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", default=os.path.join(REPO, "data", "gpt2", "shakespeare"))
    parser.add_argument("--steps", type=int, default=2, help="steps per trial")
    parser.add_argument("--trials", type=int, default=6, help="paired trials (off and on) per stage")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "watchdog.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = spawn_workers(worker, (args,))[0]
    tokens = args.steps * result["tokens_per_step"]
    rows = {}
    for stage in STAGES:
        off, on = result["times"][stage]["off"], result["times"][stage]["on"]
        step_s = statistics.median(off) / args.steps
        ops = result["ops_per_step"][stage]
        rows[f"zero{stage}"] = {
            "tokens_per_s_off": statistics.median(tokens / t for t in off),
            "tokens_per_s_on": statistics.median(tokens / t for t in on),
            "ratio_on_to_off": statistics.median(b / a for a, b in zip(on, off)),  # throughput on / off
            "marked_ops_per_step": ops, "step_s": step_s,
            "mark_bound_fraction": ops * result["mark_s"] / step_s,  # what the marks can add, at most
            "trials_off_s": off, "trials_on_s": on,
        }
    print(f"recipe GPT (gpt2_cpu.json), 2 gloo ranks x 1 thread, fp32, {result['tokens_per_step']} tokens/step, "
          f"{args.trials} paired trials of {args.steps} steps; watchdog timeout {TIMEOUT:g} s "
          f"(heartbeat every {min(max(TIMEOUT / 10, 0.5), 5.0):g} s)")
    print(f"one mark (begin + end): {result['mark_s'] * 1e6:.2f} us")
    print(f"{'stage':<8}{'tokens/s off':>14}{'tokens/s on':>13}{'on/off':>8}{'marks/step':>12}{'marks/step time':>17}")
    for name, row in rows.items():
        print(f"{name:<8}{row['tokens_per_s_off']:>14,.0f}{row['tokens_per_s_on']:>13,.0f}"
              f"{row['ratio_on_to_off']:>8.3f}{row['marked_ops_per_step']:>12.1f}"
              f"{100 * row['mark_bound_fraction']:>16.4f}%")
    write_result("watchdog", {"mark_s": result["mark_s"], "timeout_s": TIMEOUT, "steps": args.steps,
                              "trials": args.trials, "stages": rows}, args=args, out=args.out)


if __name__ == "__main__":
    main()
