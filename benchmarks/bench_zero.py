"""megazero ZeRO stages 0-3 against torch DDP and FSDP2, side by side, on the recipe's GPT.

Two gloo ranks (one thread each), the same data, initial weights, optimizer (AdamW), clipping and
precision for every configuration.
  1. Throughput: all configurations live in the same two processes and take turns (alternating
     trials of a few steps), so machine noise hits all alike; tokens/s medians and ratios to DDP.
  2. Memory: each configuration alone in two fresh processes for a few steps: peak RSS per rank
     and the model-state tensor bytes (parameters + gradients + optimizer states) per rank.
Prints a table and writes JSON (benchmarks/results/zero.json). Collectives: on gloo megazero builds
reduce-scatter from isend/irecv and all-gather from broadcasts (native ones on NCCL).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import resource
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
from megazero.profiling.memory import tensor_bytes  # noqa: E402
from megazero.zero.collectives import uses_native_collectives  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402

CONFIGS = ["ddp", "fsdp2", "zero0", "zero1", "zero2", "zero3"]
LABELS = {"ddp": "torch DDP", "fsdp2": "torch FSDP2 (fully_shard)", "zero0": "megazero ZeRO-0",
          "zero1": "megazero ZeRO-1", "zero2": "megazero ZeRO-2", "zero3": "megazero ZeRO-3"}


def recipe_config() -> dict:
    with open(os.path.join(REPO, "configs", "ds_gpt2_cpu.json")) as f:
        config = json.load(f)
    for key in ("scheduler", "tensorboard", "wandb"):
        config.pop(key, None)
    return config


def model_config() -> GPTConfig:
    return GPTConfig.from_json(os.path.join(REPO, "configs", "gpt2_cpu.json"), vocab_size=8000)


def param_groups(model: torch.nn.Module) -> list[dict]:
    return [{"params": [p for p in model.parameters() if p.dim() >= 2]},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


class MegazeroRunner:
    def __init__(self, model, stage: int, precision: str):
        config = recipe_config()
        config["zero_optimization"] = {**config["zero_optimization"], "stage": stage}
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
        self.engine, *_ = megazero.initialize(model=model, model_parameters=param_groups(model), config=config)

    def step(self, batch) -> float:
        loss = self.engine(batch["input_ids"], batch["labels"])
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def state_bytes(self) -> int:
        return self.engine.memory_report()["total"]


class TorchRunner:
    """DDP or FSDP2 with fused AdamW and clip_grad_norm_, as a torch user writes it."""

    def __init__(self, model, kind: str, precision: str):
        opt = recipe_config()["optimizer"]["params"]
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.clip = recipe_config()["gradient_clipping"]
        if kind == "ddp":
            bucket_mb = recipe_config()["zero_optimization"]["reduce_bucket_size"] * 4 / 2 ** 20
            self.model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
            fused = True
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
            fused = False  # fused AdamW does not take DTensors on CPU
        self.optimizer = torch.optim.AdamW(param_groups(model), lr=opt["lr"], betas=tuple(opt["betas"]),
                                           eps=opt["eps"], weight_decay=opt["weight_decay"], fused=fused)

    def step(self, batch) -> float:
        with torch.autocast("cpu", dtype=self.dtype, enabled=self.dtype != torch.float32):
            loss = self.model(batch["input_ids"], batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def state_bytes(self) -> int:
        tensors = [getattr(p, "_local_tensor", p) for p in self.model.parameters()]
        for state in self.optimizer.state.values():
            tensors += [getattr(v, "_local_tensor", v) for v in state.values() if torch.is_tensor(v)]
        return tensor_bytes(tensors)


def build(name: str, model, precision: str):
    if name.startswith("zero"):
        return MegazeroRunner(model, int(name[-1]), precision)
    return TorchRunner(model, name, precision)


def batches(args, steps: int) -> list[dict]:
    dataset = GPTDataset(IndexedDataset(args.data_path + "_train_text_document"), model_config().seq_length, seed=1)
    it = iter(DistributedBatchLoader(dataset, args.micro_batch, dist.get_rank(), dist.get_world_size()))
    return [next(it) for _ in range(steps)]


def init_process(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))


def throughput_worker(rank: int, world: int, port: int, args, queue) -> None:
    init_process(rank, world, port)
    megazero.set_seed(0)
    base = GPT(model_config())
    runners = {name: build(name, copy.deepcopy(base), args.precision) for name in args.configs}
    data = batches(args, args.steps)
    times = {name: [] for name in runners}
    losses = {name: [] for name in runners}
    for name, runner in runners.items():  # warm-up
        for batch in data[:args.warmup]:
            losses[name].append(runner.step(batch))
    for _ in range(args.trials):
        for name, runner in runners.items():
            dist.barrier()
            start = time.perf_counter()
            for batch in data:
                losses[name].append(runner.step(batch))
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        queue.put({"times": times, "losses": losses, "params": base.num_parameters(),
                   "native": uses_native_collectives(None)})
    dist.destroy_process_group()


def memory_worker(rank: int, world: int, port: int, args, name: str, queue) -> None:
    init_process(rank, world, port)
    megazero.set_seed(0)
    runner = build(name, GPT(model_config()), args.precision)
    for batch in batches(args, 3):
        runner.step(batch)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    queue.put((rank, {"peak_rss": peak, "state_bytes": runner.state_bytes()}))
    dist.destroy_process_group()


def spawn_workers(target, extra_args: tuple, world: int = 2, answers: int = 1) -> list:
    """Run target(rank, world, port, *extra_args, queue) in `world` fresh processes; `answers` results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *extra_args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in range(answers)]
    for p in procs:
        p.join()
    return results


def spawn(target, extra_args: tuple, world: int = 2) -> list:
    return spawn_workers(target, extra_args, world, 1 if target is throughput_worker else world)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", default=os.path.join(REPO, "data", "gpt2", "shakespeare"))
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per trial")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "zero.json"))
    args = parser.parse_args()
    result = spawn(throughput_worker, (args,))[0]
    seq = model_config().seq_length
    tokens = args.steps * args.micro_batch * 2 * seq
    rows = {}
    for name in args.configs:
        per_trial = [tokens / t for t in result["times"][name]]
        rows[name] = {"tokens_per_s": statistics.median(per_trial), "trials": per_trial}
        if "ddp" in result["times"]:
            rows[name]["ratio_to_ddp"] = statistics.median(
                d / t for d, t in zip(result["times"]["ddp"], result["times"][name]))
        reference = result["losses"][args.configs[0]]
        rows[name]["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(result["losses"][name], reference))
        if not args.skip_memory:
            per_rank = sorted(spawn(memory_worker, (args, name)))
            rows[name]["peak_rss_mb"] = [r["peak_rss"] / 2 ** 20 for _, r in per_rank]
            rows[name]["state_mb"] = [r["state_bytes"] / 2 ** 20 for _, r in per_rank]
    collectives = "native" if result["native"] else "gloo: reduce-scatter = isend/irecv + add, all-gather = broadcasts"
    print(f"GPT {result['params'] / 1e6:.1f}M params, 2 gloo ranks x 1 thread, {args.precision}, "
          f"{2 * args.micro_batch} x {seq} tokens/step, {args.trials} alternating trials of {args.steps} steps; "
          f"collectives: {collectives}")
    print(f"{'configuration':<28}{'tokens/s':>10}{'vs DDP':>8}{'peak RSS MB':>13}{'state MB':>10}{'loss diff':>11}")
    for name in args.configs:
        row = rows[name]
        rss = max(row.get("peak_rss_mb", [float("nan")]))
        state = max(row.get("state_mb", [float("nan")]))
        print(f"{LABELS[name]:<28}{row['tokens_per_s']:>10,.0f}{row.get('ratio_to_ddp', float('nan')):>8.3f}"
              f"{rss:>13,.0f}{state:>10,.1f}{row['max_rel_loss_diff']:>11.1e}")
    print("state MB: parameters + gradients + optimizer states held per rank after a step (max over ranks)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "zero", "precision": args.precision, "params": result["params"],
                   "collectives": collectives, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
