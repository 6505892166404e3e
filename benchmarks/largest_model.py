"""The largest GPT that trains a step at DP = 2 with torch DDP and with megazero ZeRO-3.

Each rank's address space is capped (RLIMIT_AS, default 11 GiB: two ranks share this 24 GiB
machine), so running out of memory is a clean allocation error instead of the OOM killer. For each
configuration the number of layers of a fixed-width GPT (fp32, AdamW, one step of 1 x 64 tokens)
is searched by bisection; every try runs in two fresh processes. ZeRO-3 builds the model under
zero.Init, as a user would for a model that does not fit one rank. Writes
benchmarks/results/largest_model.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megazero
from megazero.profiling import estimate_zero_memory
from models.gpt import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpt_config(layers: int, args) -> GPTConfig:
    return GPTConfig(vocab_size=8000, seq_length=64, num_layers=layers, hidden_size=args.hidden,
                     num_attention_heads=args.hidden // 128)


def one_step(kind: str, layers: int, args) -> None:
    config = gpt_config(layers, args)
    ids = torch.randint(0, 8000, (1, 65))
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(GPT(config))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        model(ids[:, :-1], ids[:, 1:]).backward()
        optimizer.step()
        return
    with megazero.zero.Init():
        model = GPT(config)
    engine, *_ = megazero.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 50_000_000}})
    engine.backward(engine(ids[:, :-1], ids[:, 1:]))
    engine.step()


def worker(rank: int, port: int, kind: str, layers: int, args, queue) -> None:
    limit = int(args.rank_memory_gib * 2 ** 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.set_num_threads(1)
    ok = True
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        one_step(kind, layers, args)
    except Exception as e:  # out of memory shows up as MemoryError or RuntimeError; anything else is reported
        ok = False
        if "memory" not in str(e).lower() and not isinstance(e, MemoryError):
            print(f"rank {rank}, {kind}, {layers} layers: {type(e).__name__}: {str(e)[:200]}", flush=True)
    queue.put(ok)
    queue.close()
    queue.join_thread()  # flush before leaving: os._exit skips the queue's feeder thread
    os._exit(0)  # a rank whose peer failed may be stuck in a collective: do not wait for teardown


def fits(kind: str, layers: int, args) -> bool:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, kind, layers, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in range(2):
            results.append(queue.get(timeout=args.timeout))
    except Exception:
        results.append(False)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return all(results) and len(results) == 2


def largest(kind: str, args, guess: int) -> int:
    """Bisection on the number of layers; `guess` (from the memory estimate) brackets the search."""
    lo, hi = 0, max(2, guess)
    while fits(kind, hi, args):  # grow until it fails
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        print(f"  {kind}: {mid} layers ...", flush=True)
        lo, hi = (mid, hi) if fits(kind, mid, args) else (lo, mid)
    return lo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--rank-memory-gib", type=float, default=11.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "largest_model.json"))
    args = parser.parse_args()
    per_layer = 12 * args.hidden ** 2
    budget = args.rank_memory_gib * 2 ** 30 * 0.8
    rows = {}
    for kind, stage in (("ddp", 0), ("zero3", 3)):
        per_param = estimate_zero_memory(1, 2, stage, "fp32", "adamw")["total"]
        guess = int(budget / per_param / per_layer)
        layers = largest(kind, args, guess)
        with torch.device("meta"):
            params = GPT(gpt_config(max(layers, 1), args)).num_parameters() if layers else 0
        rows[kind] = {"layers": layers, "params": params}
        print(f"{kind}: {layers} layers of width {args.hidden} = {params / 1e6:,.0f} M parameters", flush=True)
    ratio = rows["zero3"]["params"] / max(rows["ddp"]["params"], 1)
    print(f"largest trainable GPT at DP=2, {args.rank_memory_gib} GiB per rank: DDP "
          f"{rows['ddp']['params'] / 1e6:,.0f} M, ZeRO-3 {rows['zero3']['params'] / 1e6:,.0f} M "
          f"({ratio:.2f}x; expected >= 2)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "largest_model", "rank_memory_gib": args.rank_memory_gib, "hidden": args.hidden,
                   "rows": rows, "ratio": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
