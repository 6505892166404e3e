"""The largest GPT that trains a step at DP = 2 with torch DDP, megazero ZeRO-3, and ZeRO-3 with
parameters and optimizer offloaded to NVMe (ZeRO-Infinity).

Each rank's address space is capped (RLIMIT_AS, --limit-gib, default 11 GiB: two ranks share this
24 GiB machine), so running out of memory is a clean allocation error instead of the OOM killer.
For each configuration the number of layers of a fixed-width GPT (fp32, AdamW, one step of 1 x 64
tokens) is searched by bisection; every try runs in two fresh processes. ZeRO-3 builds the model
under zero.Init, as a user would for a model that does not fit one rank; zero3-nvme builds it under
zero.Init straight into swap files (offload_param and offload_optimizer nvme, --swap-dir), so no
rank ever holds it. --max-layers caps the search (a capped result is a lower bound, and says so)
and --coarse stops bisecting once the bracket is within that fraction, so the search stays cheap.
--layers tries the given layer counts only (each a full try, in order, stopping at the first that
does not fit) instead of searching: a try of a large offloaded model takes many minutes.
The step time (forward, backward, optimizer step) of the largest try is reported. Writes
benchmarks/results/largest_model.json.

    python benchmarks/largest_model.py --limit-gib 4 --hidden 1024 --kinds ddp zero3 zero3-nvme
    python benchmarks/largest_model.py --limit-gib 4 --hidden 1024 --kinds zero3-nvme --layers 136 192 --timeout 3600
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import socket
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megazero
from benchmarks.record import write_result
from megazero.profiling import estimate_zero_memory
from models.gpt import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpt_config(layers: int, args) -> GPTConfig:
    return GPTConfig(vocab_size=8000, seq_length=64, num_layers=layers, hidden_size=args.hidden,
                     num_attention_heads=args.hidden // 128)


def engine_config(kind: str, args) -> dict:
    """The megazero config of a ZeRO-3 kind (zero3: in memory; zero3-nvme: ZeRO-Infinity)."""
    zero = {"stage": 3, "reduce_bucket_size": 50_000_000}
    if kind == "zero3-nvme":
        # the buckets and sub-group buffers are what stays in memory: keep them small
        zero.update(reduce_bucket_size=10_000_000, stage3_prefetch_bucket_size=10_000_000, sub_group_size=5_000_000,
                    offload_param={"device": "nvme", "nvme_path": args.swap_dir, "max_in_cpu": 0},
                    offload_optimizer={"device": "nvme", "nvme_path": args.swap_dir, "buffer_count": 4})
    return {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": zero}


def one_step(kind: str, layers: int, args) -> float:
    """Build the model and train one step; returns the step's seconds (forward, backward, step)."""
    config = gpt_config(layers, args)
    ids = torch.randint(0, 8000, (1, 65))
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(GPT(config))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        start = time.perf_counter()
        model(ids[:, :-1], ids[:, 1:]).backward()
        optimizer.step()
        return time.perf_counter() - start
    ds_config = engine_config(kind, args)
    with megazero.zero.Init(config_dict_or_path=ds_config):
        model = GPT(config)
    engine, *_ = megazero.initialize(model=model, config=ds_config)
    del model
    start = time.perf_counter()
    engine.backward(engine(ids[:, :-1], ids[:, 1:]))
    engine.step()
    return time.perf_counter() - start


def _vm() -> str:
    """This process's peak address space (what RLIMIT_AS caps) and peak resident memory."""
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return ", ".join(f"{k} {int(status[k].split()[0]) / 1024:,.0f} MiB" for k in ("VmPeak", "VmHWM") if k in status)


def worker(rank: int, port: int, kind: str, layers: int, args, queue) -> None:
    limit = int(args.rank_memory_gib * 2 ** 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.set_num_threads(1)
    seconds = None
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=args.timeout))
        seconds = one_step(kind, layers, args)
    except Exception as e:  # out of memory shows up as MemoryError or RuntimeError; every failure is named
        where = traceback.extract_tb(e.__traceback__)[-1]
        print(f"rank {rank}, {kind}, {layers} layers: {type(e).__name__}: {str(e)[:200]} "
              f"({os.path.basename(where.filename)}:{where.lineno})", flush=True)
    print(f"rank {rank}, {kind}, {layers} layers: {_vm()}", flush=True)
    queue.put(seconds)
    queue.close()
    queue.join_thread()  # flush before leaving: os._exit skips the queue's feeder thread
    os._exit(0)  # a rank whose peer failed may be stuck in a collective: do not wait for teardown


def fits(kind: str, layers: int, args) -> float | None:
    """The step seconds (the slower rank's) when a step at `layers` layers runs on both ranks, else None."""
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
    if kind == "zero3-nvme":  # the ranks leave by os._exit (no atexit clean-up): remove their swap files
        from megazero.zero.swap import ROOT_NAME, remove_stale_runs

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            remove_stale_runs(os.path.join(args.swap_dir, ROOT_NAME))
    ok = len(results) == 2 and all(r is not None for r in results)
    return max(results) if ok else None


def largest(kind: str, args, guess: int) -> tuple[int, float | None, bool]:
    """Bisection on the number of layers; `guess` (from the memory estimate) brackets the search.
    Returns (layers, step seconds there, capped: whether --max-layers stopped the growth)."""
    def tried(layers: int) -> float | None:
        start = time.perf_counter()
        seconds = fits(kind, layers, args)
        print(f"  {kind}: {layers} layers: {'fits' if seconds is not None else 'does not fit'}"
              f"{f', step {seconds:.1f} s' if seconds is not None else ''} (try {time.perf_counter() - start:.0f} s)",
              flush=True)
        return seconds

    lo, hi, step = 0, min(max(2, guess), args.max_layers), None
    while (seconds := tried(hi)) is not None:  # grow until it fails
        lo, step = hi, seconds
        if hi >= args.max_layers:
            return lo, step, True
        hi = min(hi * 2, args.max_layers)
    while hi - lo > max(1, int(args.coarse * lo)):
        mid = (lo + hi) // 2
        seconds = tried(mid)
        if seconds is not None:
            lo, step = mid, seconds
        else:
            hi = mid
    return lo, step, False


def tried_only(kind: str, args) -> tuple[int, float | None, bool]:
    """--layers: (the largest of args.layers that fits, its step seconds, True: a lower bound)."""
    best, step = 0, None
    for layers in args.layers:
        start = time.perf_counter()
        seconds = fits(kind, layers, args)
        print(f"  {kind}: {layers} layers: {'fits' if seconds is not None else 'does not fit'}"
              f"{f', step {seconds:.1f} s' if seconds is not None else ''} (try {time.perf_counter() - start:.0f} s, "
              f"load average {os.getloadavg()[0]:.1f})", flush=True)
        if seconds is None:
            break
        best, step = layers, seconds
    return best, step, True


# per-parameter bytes each kind's first guess assumes (from the memory estimate)
KINDS = {"ddp": lambda: estimate_zero_memory(1, 2, 0, "fp32", "adamw")["total"],
         "zero3": lambda: estimate_zero_memory(1, 2, 3, "fp32", "adamw")["total"],
         "zero3-nvme": lambda: estimate_zero_memory(10 ** 9, 2, 3, "fp32", "adamw", offload_optimizer="nvme",
                                                    offload_param="nvme", sub_group_size=5_000_000, max_in_cpu=0,
                                                    reduce_bucket_size=10_000_000)["total"] / 10 ** 9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--limit-gib", "--rank-memory-gib", dest="rank_memory_gib", type=float, default=11.0,
                        help="address space per rank (RLIMIT_AS), GiB")
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=["ddp", "zero3"])
    parser.add_argument("--max-layers", type=int, default=1024, help="cap of the search (a lower bound if reached)")
    parser.add_argument("--coarse", type=float, default=0.0,
                        help="stop bisecting once the bracket is within this fraction of the largest that fits")
    parser.add_argument("--swap-dir", default=os.path.join(REPO, "data", "swap"),
                        help="zero3-nvme: offload_param/offload_optimizer nvme_path (a local disk)")
    parser.add_argument("--layers", type=int, nargs="+", default=None,
                        help="try only these layer counts, in order, up to the first that does not fit (no search)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per try")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "largest_model.json"))
    args = parser.parse_args()
    os.makedirs(args.swap_dir, exist_ok=True)
    # glibc reserves 64 MiB of address space per malloc arena (one per thread): under RLIMIT_AS that
    # reservation, not memory in use, would decide what fits once the I/O op's threads run
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")
    # and large buffers (gathered units, swap buffers) come from mmap and go back at free, not from a heap
    # that only grows: freed between live small blocks, the heap's space is reserved for good
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    per_layer = 12 * args.hidden ** 2
    budget = args.rank_memory_gib * 2 ** 30 * 0.8
    rows = {}
    for kind in args.kinds:
        per_param = KINDS[kind]()
        guess = int(budget / per_param / per_layer)
        layers, step, capped = largest(kind, args, guess) if args.layers is None else tried_only(kind, args)
        with torch.device("meta"):
            params = GPT(gpt_config(max(layers, 1), args)).num_parameters() if layers else 0
        rows[kind] = {"layers": layers, "params": params, "step_s": step, "capped": capped}
        print(f"{kind}: {'>= ' if capped else ''}{layers} layers of width {args.hidden} = {params / 1e6:,.0f} M "
              f"parameters, step {step if step is None else round(step, 1)} s", flush=True)
    base = rows.get("ddp", {}).get("params")
    for row in rows.values():
        row["x_ddp"] = row["params"] / base if base else None
        row["x_zero3"] = row["params"] / rows["zero3"]["params"] if rows.get("zero3", {}).get("params") else None
    print(f"largest trainable GPT at DP=2, {args.rank_memory_gib} GiB per rank: " + ", ".join(
        f"{kind} {'>= ' if r['capped'] else ''}{r['params'] / 1e6:,.0f} M" for kind, r in rows.items()))
    write_result("largest_model", {"rank_memory_gib": args.rank_memory_gib, "hidden": args.hidden, "rows": rows},
                 args=args, out=args.out)


if __name__ == "__main__":
    main()
