"""megazero ZeRO stages 0-3 against DeepSpeed ZeRO 0-3, torch DDP and FSDP2, side by side, on the
recipe's GPT.

Two gloo ranks (one thread each), the same data, initial weights, clipping and precision for every
configuration, dropout 0 by default, and the same optimizer: torch's
fused AdamW, passed to megazero and DeepSpeed as the client optimizer (FSDP2 gets the unfused one:
fused AdamW does not take DTensors on CPU). Dropout is 0 unless --dropout says otherwise: megazero
draws a training forward's masks from streams keyed by (seed, step, micro-batch), so that a resume
is exact, while torch and DeepSpeed draw from the global generator (seeded here per step), so with
dropout on megazero's masks, and so its losses, differ from the peers' by design (its ZeRO stages
still agree with each other, and with its single process, tests/distributed/test_data_parallel.py).
  1. Throughput: all configurations live in the same two processes and take turns (alternating
     trials of a few steps), so machine noise hits all alike; tokens/s medians, ratios to DDP and
     megazero's ratio to DeepSpeed at the same stage (medians of per-trial ratios). The losses of
     every step are compared across all configurations.
  2. Memory: each configuration alone in two fresh processes for a few steps: peak RSS per rank
     and, for torch and megazero, the model-state tensor bytes (parameters + gradients + optimizer
     states) per rank.
Prints a table and writes JSON (benchmarks/results/zero.json). DeepSpeed rows need the `bench`
extra (`make bench` installs it: pip install -e .[bench]); they run on DeepSpeed's CPU accelerator
(DS_ACCELERATOR=cpu, set here unless given) over gloo. Collectives: on gloo megazero builds
reduce-scatter from isend/irecv and all-gather from broadcasts (native ones on NCCL).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import os
import resource
import socket
import statistics
import sys
import time
import warnings
from queue import Empty

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported (spawned ranks inherit it)

import megazero  # noqa: E402
from benchmarks.record import write_result  # noqa: E402
from megazero.data import DistributedBatchLoader, GPTDataset, IndexedDataset  # noqa: E402
from megazero.profiling.memory import tensor_bytes  # noqa: E402
from megazero.zero.collectives import uses_native_collectives  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402

TORCH_CONFIGS = ["ddp", "fsdp2"]
MEGAZERO_CONFIGS = ["zero0", "zero1", "zero2", "zero3"]
DEEPSPEED_CONFIGS = ["ds0", "ds1", "ds2", "ds3"]
CONFIGS = TORCH_CONFIGS + MEGAZERO_CONFIGS + DEEPSPEED_CONFIGS
LABELS = {"ddp": "torch DDP", "fsdp2": "torch FSDP2 (fully_shard)",
          **{f"zero{s}": f"megazero ZeRO-{s}" for s in range(4)}, **{f"ds{s}": f"DeepSpeed ZeRO-{s}" for s in range(4)}}


def deepspeed_version() -> str | None:
    """The installed DeepSpeed's version, or None where it does not import."""
    try:
        import deepspeed
    except Exception:  # absent, or broken against this torch: its rows are left out
        return None
    return deepspeed.__version__


def recipe_config() -> dict:
    """The recipe's engine config (DeepSpeed-shaped) less what the benchmark does not use: the
    optimizer is the client one, no schedule (it would be the same for all), no logging."""
    with open(os.path.join(REPO, "configs", "ds_gpt2_cpu.json")) as f:
        config = json.load(f)
    for key in ("optimizer", "scheduler", "tensorboard", "wandb"):
        config.pop(key, None)
    return config


def engine_config(stage: int, precision: str) -> dict:
    """recipe_config() at ZeRO `stage` and `precision`, for megazero and DeepSpeed alike."""
    config = recipe_config()
    config["zero_optimization"] = {**config["zero_optimization"], "stage": stage}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def model_config(dropout: float) -> GPTConfig:
    return GPTConfig.from_json(os.path.join(REPO, "configs", "gpt2_cpu.json"), vocab_size=8000, dropout=dropout)


def client_optimizer(model: torch.nn.Module, fused: bool = True) -> torch.optim.AdamW:
    """The recipe's AdamW hyper-parameters on torch's (fused) AdamW."""
    with open(os.path.join(REPO, "configs", "ds_gpt2_cpu.json")) as f:
        opt = json.load(f)["optimizer"]["params"]
    return torch.optim.AdamW(param_groups(model), lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                             weight_decay=opt["weight_decay"], fused=fused)


def param_groups(model: torch.nn.Module) -> list[dict]:
    return [{"params": [p for p in model.parameters() if p.dim() >= 2]},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


class EngineRunner:
    """megazero's or DeepSpeed's engine, driven by the same DeepSpeed-style loop."""

    def __init__(self, model, name: str, precision: str):
        config = engine_config(int(name[-1]), precision)
        if name.startswith("ds"):
            import deepspeed

            deepspeed.utils.logger.setLevel(logging.WARNING)  # its per-engine INFO lines would bury the table
            config["zero_allow_untested_optimizer"] = True  # a client optimizer under ZeRO, as megazero gets
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=client_optimizer(model), config=config)
        else:
            self.engine, *_ = megazero.initialize(model=model, optimizer=client_optimizer(model), config=config)

    def step(self, batch) -> float:
        loss = self.engine(batch["input_ids"], batch["labels"])
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def state_bytes(self) -> float:
        """megazero's own report; DeepSpeed keeps its states in structures no public call reports."""
        return self.engine.memory_report()["total"] if hasattr(self.engine, "memory_report") else float("nan")


class TorchRunner:
    """DDP or FSDP2 with fused AdamW and clip_grad_norm_, as a torch user writes it."""

    def __init__(self, model, kind: str, precision: str):
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
        self.optimizer = client_optimizer(model, fused=fused)

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
    if name in TORCH_CONFIGS:
        return TorchRunner(model, name, precision)
    return EngineRunner(model, name, precision)


def seeded_step(runner, batch, step: int) -> float:
    """One training step with the generator seeded by the step's index: every configuration draws
    the same dropout masks at the same step, whatever ran before it in this process."""
    torch.manual_seed(1000 + step)
    return runner.step(batch)


def batches(args, steps: int) -> list[dict]:
    dataset = GPTDataset(IndexedDataset(args.data_path + "_train_text_document"), model_config(0).seq_length, seed=1)
    it = iter(DistributedBatchLoader(dataset, args.micro_batch, dist.get_rank(), dist.get_world_size()))
    return [next(it) for _ in range(steps)]


def init_process(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use `torch.distributed")  # DeepSpeed's calls
    # what torchrun sets: DeepSpeed's engine requires LOCAL_RANK even over an initialized process group
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))


def throughput_worker(rank: int, world: int, port: int, args, queue) -> None:
    init_process(rank, world, port)
    megazero.set_seed(0)
    base = GPT(model_config(args.dropout))
    runners = {name: build(name, copy.deepcopy(base), args.precision) for name in args.configs}
    data = batches(args, args.steps)
    times = {name: [] for name in runners}
    losses = {name: [] for name in runners}
    for name, runner in runners.items():  # warm-up
        for step, batch in enumerate(data[:args.warmup]):
            losses[name].append(seeded_step(runner, batch, step))
    for trial in range(args.trials):
        for name, runner in runners.items():
            dist.barrier()
            start = time.perf_counter()
            for i, batch in enumerate(data):
                losses[name].append(seeded_step(runner, batch, args.warmup + trial * len(data) + i))
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        queue.put({"times": times, "losses": losses, "params": base.num_parameters(),
                   "native": uses_native_collectives(None)})
    dist.destroy_process_group()


def memory_worker(rank: int, world: int, port: int, args, name: str, queue) -> None:
    init_process(rank, world, port)
    megazero.set_seed(0)
    runner = build(name, GPT(model_config(args.dropout)), args.precision)
    for step, batch in enumerate(batches(args, 3)):
        seeded_step(runner, batch, step)
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
    results = []
    while len(results) < answers:
        try:
            results.append(queue.get(timeout=5))
        except Empty:  # a rank that died would leave the others waiting for ever
            dead = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.terminate()
                sys.exit(f"{target.__name__}: rank {dead[0][0]} exited with code {dead[0][1]} (its traceback is above)")
    for p in procs:
        p.join()
    return results


def spawn(target, extra_args: tuple, world: int = 2) -> list:
    return spawn_workers(target, extra_args, world, 1 if target is throughput_worker else world)


def median_ratio(times: dict, base: str, name: str) -> float:
    """Median over trials of base's time / name's time (> 1: name is faster)."""
    return statistics.median(b / t for b, t in zip(times[base], times[name]))


def summarize(result: dict, args, tokens: int) -> dict:
    """Per configuration: tokens/s, ratios to DDP and (megazero) to DeepSpeed at the same stage, and
    the largest loss difference from the first configuration at any step."""
    times, reference = result["times"], result["losses"][args.configs[0]]
    rows = {}
    for name in args.configs:
        per_trial = [tokens / t for t in times[name]]
        rows[name] = {"tokens_per_s": statistics.median(per_trial), "trials": per_trial,
                      "losses": result["losses"][name],
                      "max_abs_loss_diff": max(abs(a - b) for a, b in zip(result["losses"][name], reference))}
        if "ddp" in times:
            rows[name]["ratio_to_ddp"] = median_ratio(times, "ddp", name)
        peer = f"ds{name[-1]}"
        if name in MEGAZERO_CONFIGS and peer in times:
            rows[name]["ratio_to_deepspeed"] = median_ratio(times, peer, name)
    return rows


# beyond rounding (bf16's included, over the benchmark's few steps): a different computation, named as such
AGREE_RTOL = 0.01


def loss_verdict(rows: dict, configs: list[str], steps: int) -> str:
    """One line saying whether every configuration's losses equal the first's at every step, and
    otherwise by how many fp32 units in the last place (the reductions' order differs); those more
    than AGREE_RTOL away at some step are named apart, as differing."""
    scale = max(abs(x) for x in rows[configs[0]]["losses"])
    differ = [n for n in configs if rows[n]["max_abs_loss_diff"] > AGREE_RTOL * scale]
    agree = [n for n in configs if n not in differ]
    apart = ("; differ by more than 1%: " + ", ".join(f"{LABELS[n]} (by up to {rows[n]['max_abs_loss_diff']:.3g})"
                                                        for n in differ)) if differ else ""
    worst = max(agree, key=lambda n: rows[n]["max_abs_loss_diff"])
    diff = rows[worst]["max_abs_loss_diff"]
    if diff == 0.0:
        return f"losses: identical (bit for bit) in {len(agree)} configurations at each of {steps} steps{apart}"
    ulp = float(np.spacing(np.float32(scale)))
    return (f"losses: equal in {len(agree)} configurations at each of {steps} steps within {diff:.2e} "
            f"({diff / ulp:.0f} fp32 ulp at the loss's magnitude; largest: {LABELS[worst]} vs {LABELS[configs[0]]})"
            f"{apart}")


def print_table(rows: dict, configs: list[str]) -> None:
    nan = float("nan")
    print(f"{'configuration':<28}{'tokens/s':>10}{'vs DDP':>8}{'vs DeepSpeed':>14}{'peak RSS MB':>13}"
          f"{'state MB':>10}{'loss diff':>11}")
    for name in configs:
        row = rows[name]
        vs_ds = f"{row['ratio_to_deepspeed']:.3f}" if "ratio_to_deepspeed" in row else "-"
        state = max(row.get("state_mb", [nan]))
        print(f"{LABELS[name]:<28}{row['tokens_per_s']:>10,.0f}{row.get('ratio_to_ddp', nan):>8.3f}{vs_ds:>14}"
              f"{max(row.get('peak_rss_mb', [nan])):>13,.0f}{'-' if state != state else f'{state:,.1f}':>10}"
              f"{row['max_abs_loss_diff']:>11.1e}")
    print("vs DDP / vs DeepSpeed: median over trials of the ratio of step times (> 1: faster); "
          "state MB: parameters + gradients + optimizer states held per rank after a step (max over ranks); "
          f"loss diff: largest |loss - {LABELS[configs[0]]}'s| at any step")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", default=os.path.join(REPO, "data", "gpt2", "shakespeare"))
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--configs", nargs="+", default=None, choices=CONFIGS,
                        help="default: all (the DeepSpeed ones where deepspeed imports)")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="> 0: megazero's keyed dropout masks differ from the peers' (see the docstring)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per trial")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "zero.json"))
    args = parser.parse_args()
    version = deepspeed_version()
    if args.configs is None:
        args.configs = CONFIGS if version else TORCH_CONFIGS + MEGAZERO_CONFIGS
        if not version:
            print("DeepSpeed is not installed: its rows are left out (`make bench`, or pip install -e .[bench], "
                  "adds them)", flush=True)
    elif not version and set(args.configs) & set(DEEPSPEED_CONFIGS):
        sys.exit("--configs names DeepSpeed ones but deepspeed does not import: pip install -e .[bench]")
    args.deepspeed = version
    return args


def main() -> None:
    args = parse_args()
    result = spawn(throughput_worker, (args,))[0]
    seq = model_config(args.dropout).seq_length
    rows = summarize(result, args, args.steps * args.micro_batch * 2 * seq)
    if not args.skip_memory:
        for name in args.configs:
            per_rank = sorted(spawn(memory_worker, (args, name)))
            rows[name]["peak_rss_mb"] = [r["peak_rss"] / 2 ** 20 for _, r in per_rank]
            rows[name]["state_mb"] = [r["state_bytes"] / 2 ** 20 for _, r in per_rank]
    collectives = "native" if result["native"] else "gloo: reduce-scatter = isend/irecv + add, all-gather = broadcasts"
    steps = args.warmup + args.trials * args.steps
    print(f"GPT {result['params'] / 1e6:.1f}M params, dropout {args.dropout}, 2 gloo ranks x 1 thread, "
          f"{args.precision}, {2 * args.micro_batch} x {seq} tokens/step, {args.trials} alternating trials of "
          f"{args.steps} steps; torch fused AdamW for all but FSDP2; DeepSpeed {args.deepspeed or 'not installed'}; "
          f"megazero collectives: {collectives}")
    print_table(rows, args.configs)
    verdict = loss_verdict(rows, args.configs, steps)
    print(verdict)
    write_result("zero", {"precision": args.precision, "dropout": args.dropout, "params": result["params"],
                          "deepspeed": args.deepspeed, "collectives": collectives, "losses": verdict,
                          "rows": rows}, args=args, out=args.out)


if __name__ == "__main__":
    main()
