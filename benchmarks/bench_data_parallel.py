"""megazero DP (ZeRO stage 0) against torch DistributedDataParallel, side by side in one run.

Two gloo ranks (one thread each) train the recipe's GPT on the same data, from the same weights,
with the same optimizer (fused AdamW), clipping and precision. Trials alternate between the two so
machine noise hits both alike. Prints a table and writes JSON (benchmarks/results/data_parallel.json).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import megazero  # noqa: E402
from megazero.data import DistributedBatchLoader, GPTDataset, IndexedDataset  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402


def engine_config(args) -> dict:
    with open(os.path.join(REPO, "configs", "ds_gpt2_cpu.json")) as f:
        config = json.load(f)
    for key in ("scheduler", "tensorboard", "wandb"):
        config.pop(key, None)
    if args.precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def param_groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2]},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def make_batches(args, rank: int, world: int, steps: int) -> list[dict]:
    config = GPTConfig.from_json(os.path.join(REPO, "configs", "gpt2_cpu.json"), vocab_size=8000)
    dataset = GPTDataset(IndexedDataset(args.data_path + "_train_text_document"), config.seq_length, seed=1)
    loader = DistributedBatchLoader(dataset, args.micro_batch, rank, world)
    it = iter(loader)
    return [next(it) for _ in range(steps)]


def run_megazero(engine, batches) -> tuple[float, list[float]]:
    start = time.perf_counter()
    losses = []
    for batch in batches:
        loss = engine(batch["input_ids"], batch["labels"])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return time.perf_counter() - start, losses


def run_ddp(ddp, optimizer, batches, clip: float, dtype) -> tuple[float, list[float]]:
    start = time.perf_counter()
    losses = []
    for batch in batches:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = ddp(batch["input_ids"], batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return time.perf_counter() - start, losses


def worker(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    megazero.set_seed(0)
    config = GPTConfig.from_json(os.path.join(REPO, "configs", "gpt2_cpu.json"), vocab_size=8000)
    model = GPT(config)
    ddp_model = copy.deepcopy(model)
    cfg = engine_config(args)
    engine, _, _, _ = megazero.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    opt_params = cfg["optimizer"]["params"]
    ddp = torch.nn.parallel.DistributedDataParallel(
        ddp_model, bucket_cap_mb=cfg["zero_optimization"]["reduce_bucket_size"] * 4 / 2**20)
    optimizer = torch.optim.AdamW(param_groups(ddp_model), lr=opt_params["lr"], betas=tuple(opt_params["betas"]),
                                  eps=opt_params["eps"], weight_decay=opt_params["weight_decay"], fused=True)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    batches = make_batches(args, rank, world, args.steps)
    times = {"megazero": [], "ddp": []}
    losses = {"megazero": [], "ddp": []}
    run_megazero(engine, batches[:args.warmup])
    run_ddp(ddp, optimizer, batches[:args.warmup], cfg["gradient_clipping"], dtype)
    for _ in range(args.trials):
        for name in ("megazero", "ddp"):
            dist.barrier()
            if name == "megazero":
                elapsed, step_losses = run_megazero(engine, batches)
            else:
                elapsed, step_losses = run_ddp(ddp, optimizer, batches, cfg["gradient_clipping"], dtype)
            times[name].append(elapsed)
            losses[name].extend(step_losses)
    if rank == 0:
        queue.put({"times": times, "losses": losses, "params": sum(p.numel() for p in model.parameters()),
                   "seq_length": config.seq_length, "train_batch_size": engine.train_batch_size(),
                   "buckets": engine.dp.bucket_count})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-path", default=os.path.join(REPO, "data", "gpt2", "shakespeare"))
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per trial")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "data_parallel.json"))
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
    tokens = args.steps * result["train_batch_size"] * result["seq_length"]
    rows = {}
    for name in ("megazero", "ddp"):
        per_trial = [tokens / t for t in result["times"][name]]
        rows[name] = {"tokens_per_s_median": statistics.median(per_trial), "tokens_per_s_trials": per_trial}
    # each trial pairs the two back to back, so the median of per-trial ratios cancels slow drifts
    ratio = statistics.median(a / b for a, b in zip(result["times"]["ddp"], result["times"]["megazero"]))
    pairs = zip(result["losses"]["megazero"], result["losses"]["ddp"])
    loss_diff = max(abs(a - b) / abs(b) for a, b in pairs)
    print(f"GPT {result['params'] / 1e6:.1f}M params, 2 gloo ranks x 1 thread, {args.precision}, "
          f"{result['train_batch_size']} x {result['seq_length']} tokens/step, {args.trials} alternating trials "
          f"of {args.steps} steps, megazero buckets: {result['buckets']}")
    print(f"{'configuration':<24}{'tokens/s median':>16}{'min':>8}{'max':>8}")
    for name, label in (("megazero", "megazero DP (ZeRO-0)"), ("ddp", "torch DDP")):
        trials = rows[name]["tokens_per_s_trials"]
        print(f"{label:<24}{rows[name]['tokens_per_s_median']:>16,.0f}{min(trials):>8,.0f}{max(trials):>8,.0f}")
    print(f"ratio megazero / DDP (median of paired trials): {ratio:.3f}   (target >= 1.0)")
    print(f"max relative loss difference megazero vs DDP over all steps: {loss_diff:.2e}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "data_parallel", "precision": args.precision, "rows": rows, "ratio": ratio,
                   "max_relative_loss_difference": loss_diff, "params": result["params"],
                   "tokens_per_step": result["train_batch_size"] * result["seq_length"]}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
