"""The 1-bit optimizers against their plain counterparts, on 2 gloo ranks (one thread each), in one run.

A GPT where communication is a large share of Adam's step (wide, 4 layers, 128 tokens per rank per
step: data-parallel training of a large model on a slow network, which is where these optimizers
pay): 1-bit Adam and 0/1 Adam against Adam, 1-bit LAMB against LAMB (all without bias correction,
as DeepSpeed's 1-bit optimizers: so the warm-up is the plain optimizer's, step for step).

1. Loss: each pair trains from the same seed on the same batches, in turns, for --steps steps
   (--freeze-step of them the warm-up); the loss is compared over the last 10 steps.
2. Throughput after the warm-up: the trained engines take turns for --trials trials of
   --trial-steps steps each; tokens/s is the median of per-trial ratios to the plain optimizer.
   Bytes sent per step are this rank's, counted by megazero.zero.collectives.traffic. The plain
   optimizer's communication share is 1 - (its step time with gradients kept local, no
   communication) / (its step time), measured in the same trials.

fp32 (the engine's fp32 master weights are what the optimizers see in any precision). Writes
benchmarks/results/onebit.json. `--quick`: a tiny shape and a few steps, to check that it runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import megazero
from benchmarks.bench_zero import init_process, spawn_workers
from benchmarks.record import write_result
from megazero.data import GPTDataset, IndexedDataset
from megazero.zero.collectives import traffic
from models.gpt import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = {"num_layers": 4, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 32}
QUICK = {"num_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 64}
BETAS = [0.9, 0.99]  # the variance settles within the warm-up (0.999 would need thousands of steps)
LOSS_WINDOW = 10
# (compressed optimizer, its plain counterpart, its compression keys beyond freeze_step's)
PAIRS = [("OneBitAdam", "Adam", {}), ("ZeroOneAdam", "Adam", {"var_update_scaler": 16, "local_step_scaler": 16,
                                                                "local_step_clipper": 4}),
         ("OneBitLamb", "Lamb", {})]


def optimizer_block(name: str, args, extra: dict) -> dict:
    params = {"lr": args.lr, "betas": BETAS, "weight_decay": 0.01, "bias_correction": False}
    if name == "ZeroOneAdam":
        params.update(var_freeze_step=args.freeze_step, **extra)
    elif name.startswith("OneBit"):
        params.update(freeze_step=args.freeze_step, **extra)
    return {"type": name, "params": params}


class Run:
    """One engine over the recipe's data, built from seed 0 (so every run starts from the same weights)."""

    def __init__(self, optimizer: dict, args, local: bool = False):
        megazero.set_seed(0)
        self.config = GPTConfig(vocab_size=8000, dropout=0.0, **(QUICK if args.quick else SHAPE))
        model = GPT(self.config)
        dataset = GPTDataset(IndexedDataset(args.data_path + "_train_text_document"), self.config.seq_length, seed=1)
        engine_config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
                         "optimizer": optimizer, "steps_per_print": 10**9,
                         "zero_optimization": {"stage": 0, "reduce_bucket_size": 50_000_000}}
        self.engine, _, loader, _ = megazero.initialize(model=model, training_data=dataset, config=engine_config)
        self.data = iter(loader)
        self.local = local  # gradients never communicated: the step without its communication

    def step(self) -> float:
        if self.local:
            self.engine.dp.local_gradients = True
        return self.engine.train_batch(self.data).item()


def mean_loss(loss: float) -> float:
    value = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def compare(compressed: str, plain: str, extra: dict, args) -> dict:
    """Parts 1 and 2 for one pair, on this rank."""
    runs = {compressed: Run(optimizer_block(compressed, args, extra), args),
            plain: Run(optimizer_block(plain, args, {}), args)}
    losses = {name: [] for name in runs}
    for _ in range(args.steps):
        for name, run in runs.items():
            losses[name].append(mean_loss(run.step()))
    if plain == "Adam":  # the step without communication, warmed up like the others
        runs["no_communication"] = Run(optimizer_block(plain, args, {}), args, local=True)
        for _ in range(2):
            runs["no_communication"].step()
    times = {name: [] for name in runs}
    sent = {name: [] for name in runs}
    for _ in range(args.trials):
        for name, run in runs.items():
            dist.barrier()
            traffic.reset()
            start = time.perf_counter()
            for _ in range(args.trial_steps):
                run.step()
            times[name].append(time.perf_counter() - start)
            sent[name].append(traffic.sent_bytes / args.trial_steps)
    return {"losses": losses, "times": times, "sent_bytes": sent,
            "parameters": sum(p.numel() for p in runs[plain].engine.module.parameters())}


def worker(rank: int, world: int, port: int, args, queue) -> None:
    init_process(rank, world, port)
    results = {compressed: compare(compressed, plain, extra, args) for compressed, plain, extra in pairs(args)}
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def pairs(args) -> list:
    """The PAIRS --optimizers names (all by default)."""
    return [pair for pair in PAIRS if pair[0] in args.optimizers]


def summarize(results: dict, args) -> dict:
    tokens = args.trial_steps * 2 * (QUICK if args.quick else SHAPE)["seq_length"]
    rows = {}
    for compressed, plain, extra in pairs(args):
        result = results[compressed]
        # the plain optimizer's steps: the warm-up (0/1 Adam: its first var_update_scaler variance steps)
        plain_steps = min(extra.get("var_update_scaler", args.freeze_step), args.freeze_step)
        times, losses = result["times"], result["losses"]
        ratio = statistics.median(p / c for p, c in zip(times[plain], times[compressed]))
        final = {name: statistics.fmean(values[-LOSS_WINDOW:]) for name, values in losses.items()}
        rows[compressed] = {
            "baseline": plain, "parameters": result["parameters"],
            "tokens_per_s": statistics.median(tokens / t for t in times[compressed]),
            "baseline_tokens_per_s": statistics.median(tokens / t for t in times[plain]),
            "speedup": ratio,
            "sent_bytes_per_step": statistics.median(result["sent_bytes"][compressed]),
            "baseline_sent_bytes_per_step": statistics.median(result["sent_bytes"][plain]),
            "loss": final[compressed], "baseline_loss": final[plain],
            "loss_ratio": final[compressed] / final[plain],
            "warmup_steps": plain_steps,
            "warmup_equal": losses[compressed][:plain_steps] == losses[plain][:plain_steps],
            "losses": losses[compressed], "baseline_losses": losses[plain],
        }
        if "no_communication" in times:
            rows[compressed]["baseline_communication_share"] = statistics.median(
                1 - n / p for n, p in zip(times["no_communication"], times[plain]))
    return rows


def print_table(rows: dict, args) -> None:
    first = next(iter(rows.values()))
    print(f"2 gloo ranks, one thread each; GPT {first['parameters'] / 1e6:.1f} M parameters, "
          f"{args.steps} steps ({args.freeze_step} warm-up), loss over the last {LOSS_WINDOW}")
    print(f"{'optimizer':<12} {'vs':<5} {'tokens/s':>9} {'speedup':>8} {'MB sent/step':>13} {'vs plain':>9} "
          f"{'loss':>7} {'plain':>7} {'warm-up equal':>14}")
    for name, r in rows.items():
        print(f"{name:<12} {r['baseline']:<5} {r['tokens_per_s']:>9.1f} {r['speedup']:>7.2f}x "
              f"{r['sent_bytes_per_step'] / 1e6:>13.2f} {r['baseline_sent_bytes_per_step'] / 1e6:>9.1f} "
              f"{r['loss']:>7.3f} {r['baseline_loss']:>7.3f} {str(r['warmup_equal']):>14}")
    share = next((r["baseline_communication_share"] for r in rows.values()
                  if "baseline_communication_share" in r), None)
    if share is not None:
        print(f"Adam's communication share of its step: {share:.0%}")
    print("target: speedup >= 1.3x, loss within 2%")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", default=os.path.join(REPO, "data", "gpt2", "shakespeare"))
    parser.add_argument("--steps", type=int, default=160, help="part 1: steps of each optimizer")
    parser.add_argument("--freeze-step", type=int, default=100, help="warm-up steps (0/1 Adam: var_freeze_step)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--optimizers", nargs="+", default=[pair[0] for pair in PAIRS], choices=[p[0] for p in PAIRS])
    parser.add_argument("--trial-steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny shape, 12 steps, 2 trials")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "onebit.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.freeze_step, args.trials, args.trial_steps = 12, 6, 2, 2
    torch.set_num_threads(1)
    rows = summarize(spawn_workers(worker, (args,))[0], args)
    print_table(rows, args)
    write_result("onebit", {"rows": rows}, args=args, argv=argv, out=args.out)
    return rows


if __name__ == "__main__":
    main()
