"""Muon against AdamW on the recipe's GPT (configs/gpt2_cpu.json, the corpus data/gpt2/shakespeare),
in one run.

1. Step time, side by side: engines built from the same seed take turns (--trials trials of
   --trial-steps steps each, after 2 warm-up steps) at DP=1 (one process, both cores) and DP=2 (two
   gloo ranks, one core each): AdamW (megazero's fused CPU op), Muon (bf16 Newton-Schulz, the
   default), Muon with fp32 Newton-Schulz, and at DP=2 Muon at ZeRO-1 (each bucket's momentum
   all-gathered, its updates reduce-scattered) and Muon with every rank orthogonalising every
   matrix (no owners: what the round-robin saves). Reported: the median step time, Muon's added
   time over AdamW's step, and the time per step each rank spends in the orthogonalizer.
2. Validation loss at the same tokens: the GPT recipe (scripts/pretrain_gpt2.sh, its defaults) for
   --iters iterations with its AdamW engine JSON, and with that JSON's optimizer made Muon (lr
   --muon-lr, its decay 0 as the reference's; the JSON's AdamW keys for the embeddings, norms and
   biases, lr --muon-adamw-lr), validated every --eval-interval iterations; both curves written.

    python benchmarks/bench_muon.py [--trials 5] [--iters 300] [--skip-loss]

Writes benchmarks/results/muon.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import megazero
from benchmarks.bench_zero import init_process, spawn_workers
from benchmarks.record import REPO, write_result
from megazero.data import GPTDataset, IndexedDataset
from megazero.optim.muon import whole_tensor_orthogonalizer
from models.gpt import GPT, GPTConfig

DATA = os.path.join(REPO, "data", "gpt2", "shakespeare")
GLOBAL_BATCH, MICRO = 8, 4


def _optimizer(kind: str) -> dict:
    if kind == "adamw":
        return {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}}
    params = {"lr": 0.02, "adamw_lr": 1e-3, "weight_decay": 0.01, "adamw_weight_decay": 0.1}
    if kind == "muon_fp32":
        params["ns_dtype"] = "float32"
    return {"type": "Muon", "params": params}


# name -> (optimizer kind, ZeRO stage, every rank orthogonalises everything)
RUNS = {"adamw": ("adamw", 0, False), "muon": ("muon", 0, False), "muon_fp32": ("muon_fp32", 0, False)}
RUNS_DP2 = {"muon_zero1": ("muon", 1, False), "muon_no_owners": ("muon", 0, True)}


class TimedOrthogonalizer:
    """Wraps an optimizer's orthogonalizer, adding up the seconds spent in it."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, 0.0

    def __call__(self, items, group):
        start = time.perf_counter()
        try:
            return self.inner(items, group)
        finally:
            self.seconds += time.perf_counter() - start


class Run:
    """One engine over the corpus from seed 0 (every run starts from the same weights)."""

    def __init__(self, kind: str, stage: int, no_owners: bool, world: int):
        megazero.set_seed(0)
        with open(os.path.join(REPO, "configs", "gpt2_cpu.json")) as f:
            config = GPTConfig(vocab_size=8000, **json.load(f))
        dataset = GPTDataset(IndexedDataset(DATA + "_train_text_document"), config.seq_length, seed=1)
        engine_config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO,
                         "gradient_clipping": 1.0, "optimizer": _optimizer(kind), "steps_per_print": 10**9,
                         "zero_optimization": {"stage": stage, "reduce_bucket_size": 2_000_000}}
        self.engine, _, loader, _ = megazero.initialize(model=GPT(config), training_data=dataset,
                                                        config=engine_config)
        self.data = iter(loader)
        self.timer = None
        if kind != "adamw":
            inner = whole_tensor_orthogonalizer if no_owners else self.engine.optimizer.orthogonalizer
            self.timer = TimedOrthogonalizer(inner)
            self.engine.optimizer.bind_orthogonalizer(self.timer)

    def step(self) -> float:
        return self.engine.train_batch(self.data).item()


def worker(rank: int, world: int, port: int, args, queue) -> None:
    init_process(rank, world, port)
    if world == 1:
        torch.set_num_threads(2)  # the same 2 cores as the two ranks
    runs = {name: Run(*spec, world) for name, spec in {**RUNS, **(RUNS_DP2 if world > 1 else {})}.items()}
    for run in runs.values():
        for _ in range(2):
            run.step()
    times = {name: [] for name in runs}
    ortho = {name: [] for name in runs}
    for _ in range(args.trials):
        for name, run in runs.items():
            dist.barrier()
            before = run.timer.seconds if run.timer else 0.0
            start = time.perf_counter()
            for _ in range(args.trial_steps):
                run.step()
            times[name].append((time.perf_counter() - start) / args.trial_steps)
            ortho[name].append(((run.timer.seconds if run.timer else 0.0) - before) / args.trial_steps)
    if rank == 0:
        queue.put({"times": times, "ortho": ortho})
    dist.destroy_process_group()


def step_rows(args) -> list[dict]:
    rows = []
    for world in (1, 2):
        (result,) = spawn_workers(worker, (args,), world=world)
        adamw = statistics.median(result["times"]["adamw"])
        for name, times in result["times"].items():
            step = statistics.median(times)
            rows.append({"dp": world, "run": name, "step_ms": round(1000 * step, 1),
                         "vs_adamw": round(step / adamw, 3), "added_ms": round(1000 * (step - adamw), 1),
                         "orthogonalize_ms": round(1000 * statistics.median(result["ortho"][name]), 1)})
            print(f"DP={world} {name:>15}: {rows[-1]['step_ms']:8.1f} ms/step ({rows[-1]['vs_adamw']:.3f}x AdamW), "
                  f"orthogonalizer {rows[-1]['orthogonalize_ms']:.1f} ms", flush=True)
    return rows


def _validation_curve(log_dir: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return [(e.step, round(e.value, 4)) for e in acc.Scalars("lm loss validation")]


def loss_curves(args) -> dict:
    """The recipe with AdamW (its JSON) and with Muon, one after the other, in a scratch directory."""
    curves = {}
    for name, flags in {"adamw": [], "muon": ["--lr", str(args.muon_lr)]}.items():
        with tempfile.TemporaryDirectory() as scratch:
            engine = os.path.join(scratch, "engine.json")
            with open(os.path.join(REPO, "configs", "ds_gpt2_cpu.json")) as f:
                config = json.load(f)
            if name == "muon":  # the AdamW block's keys for the rest; Muon's decay the reference's 0
                adam = config["optimizer"]["params"]
                config["optimizer"] = {"type": "Muon", "params": {
                    "weight_decay": 0.0, "adamw_lr": args.muon_adamw_lr, "adamw_weight_decay": adam["weight_decay"],
                    "adamw_betas": adam["betas"], "adamw_eps": adam["eps"]}}
            with open(engine, "w") as f:
                json.dump(config, f)
            tb = os.path.join(scratch, "tb")
            env = {**os.environ, "CONFIG": engine, "SAVE_DIR": os.path.join(scratch, "ckpt"), "TB_DIR": tb}
            start = time.perf_counter()
            subprocess.run(["bash", os.path.join(REPO, "scripts", "pretrain_gpt2.sh"), "--train-iters",
                            str(args.iters), "--train-minutes", "1000", "--eval-interval", str(args.eval_interval),
                            "--save-interval", str(10**6), *flags], check=True, cwd=REPO, env=env,
                           stdout=subprocess.DEVNULL)
            curves[name] = {"validation": _validation_curve(tb), "seconds": round(time.perf_counter() - start, 1)}
            print(f"{name}: validation {curves[name]['validation']}", flush=True)
    return curves


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--trial-steps", type=int, default=3)
    parser.add_argument("--iters", type=int, default=300, help="recipe iterations of each validation-loss run")
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--muon-lr", type=float, default=0.02)
    parser.add_argument("--muon-adamw-lr", type=float, default=1e-3, help="the AdamW JSON's lr")
    parser.add_argument("--skip-loss", action="store_true", help="step times only")
    parser.add_argument("--out", default=None, help="result file (default benchmarks/results/muon.json)")
    args = parser.parse_args(argv)
    if not os.path.exists(DATA + "_train_text_document.idx"):
        subprocess.run(["make", "-C", REPO, "data", f"PYTHON={sys.executable}"], check=True)
    result = {"steps": step_rows(args)}
    if not args.skip_loss:
        result["loss"] = loss_curves(args)
        final = {name: curve["validation"][-1][1] for name, curve in result["loss"].items()}
        result["verdict"] = (f"validation loss after {args.iters} iterations: Muon {final['muon']} vs AdamW "
                             f"{final['adamw']} ({'lower' if final['muon'] < final['adamw'] else 'NOT lower'})")
        print(result["verdict"])
    write_result("muon", result, args=args, argv=argv, out=args.out)
    return result


if __name__ == "__main__":
    main()
