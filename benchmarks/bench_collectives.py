"""gloo's native reduce-scatter and all-gather against megazero's compositions of them.

Two gloo ranks (one thread each) on loopback, a 64 MiB fp32 buffer. The four operations take turns
in one run (alternating trials), so machine noise hits all alike; medians and the speed-up of each
composition over the native call. This is why megazero.zero.collectives builds reduce-scatter from
isend/irecv plus an add, and all-gather from one broadcast per rank, on gloo. Writes
benchmarks/results/collectives.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.record import write_result
from megazero.zero.collectives import all_gather_chunks, reduce_scatter_chunks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def operations(buffer: torch.Tensor) -> dict:
    """name -> a call that runs one collective over `buffer` to completion."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = buffer.view(world, -1)[rank]
    return {
        "reduce_scatter_tensor (native)": lambda: dist.reduce_scatter_tensor(mine, buffer),
        "megazero reduce-scatter (isend/irecv + add)": lambda: reduce_scatter_chunks(buffer, None).wait(),
        "all_gather_into_tensor (native)": lambda: dist.all_gather_into_tensor(buffer, mine.clone()),
        "megazero all-gather (one broadcast per rank)": lambda: all_gather_chunks(buffer, None).wait(),
    }


def worker(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use `torch.distributed")  # the native calls
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    buffer = torch.randn(int(args.mib * 2 ** 20 / 4))
    ops = operations(buffer)
    times = {name: [] for name in ops}
    for fn in ops.values():  # warm-up: connections, pages
        fn()
    for _ in range(args.trials):
        for name, fn in ops.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=64.0, help="buffer size in MiB (fp32)")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "collectives.json"))
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    times = queue.get()
    for p in procs:
        p.join()
    rows = {name: {"ms": 1000 * statistics.median(t)} for name, t in times.items()}
    names = list(rows)
    for native, built in ((names[0], names[1]), (names[2], names[3])):
        rows[built]["vs native"] = statistics.median(n / b for n, b in zip(times[native], times[built]))
    print(f"2 gloo ranks x 1 thread, {args.mib:g} MiB fp32, median of {args.trials} alternating trials")
    print(f"{'operation':<46}{'ms':>8}  speed-up")
    for name, row in rows.items():
        extra = f"{row['vs native']:.2f}x native" if "vs native" in row else ""
        print(f"{name:<46}{row['ms']:>8.1f}  {extra}")
    write_result("collectives", {"mib": args.mib, "rows": rows}, args=args, out=args.out)


if __name__ == "__main__":
    main()
