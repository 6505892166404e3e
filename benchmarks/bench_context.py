"""Context parallelism against one process on long sequences: the CPU Llama (configs/llama_cpu.json)
at each sequence length, one sample per step, run as CP=1 (one process, both cores) and CP=2 (two
gloo ranks, one core each) with ring (p2p) and all-to-all (a2a) attention, one after another in
one run: the activations each rank keeps for backward (engine.last_activation_bytes), its peak RSS
and tokens/s, with the CP=2 / CP=1 ratios, and the exposed share of the step: the time a rank spent
blocked in context-parallel communication (megazero.context_parallel.comm.exposed: the all-to-alls
whole, a ring hop from its wait on), over the step time (the largest rank's). Sequences longer
than 8k time --long-steps steps (one step of 32k tokens takes minutes here).

Then the longest sequence that trains a step under a per-rank memory cap (RLIMIT_AS, --cap-gib, as
benchmarks/largest_model.py caps ranks: running out is a clean allocation error), for each mode:
doubled from 2k until a step fails, then bisected to --granule tokens, every try in fresh processes.
The search's ranks run with glibc's mmap threshold fixed (--mmap-threshold, MALLOC_MMAP_THRESHOLD_,
every mode alike): under glibc's dynamic threshold a freed block of a few MiB raises the threshold,
later blocks below it come from the heap, and what they leave there counts against the cap; the
all-to-all's buffers did that most (its peak address space 12% above the ring's at 16k), so the
search would measure the allocator's fragmentation rather than the attention's memory.

    python benchmarks/bench_context.py [--seq-lengths 2048 4096 8192 16384 32768] [--steps 3] [--cap-gib 3]

Targets (issue 38): activations per rank at CP=2 <= 0.55x CP=1's at 8k and beyond; CP=2 tokens/s
>= 0.9x CP=1's at 8k; the longest sequence under the cap at CP=2 >= 1.8x CP=1's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import socket
import statistics
import time
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.record import REPO, write_result

MODES = [("cp1", 1, "p2p"), ("cp2_p2p", 2, "p2p"), ("cp2_a2a", 2, "a2a")]
ACTIVATION_TARGET, SPEED_TARGET, LONGEST_TARGET = 0.55, 0.9, 1.8
LONG = 8192  # longer sequences time --long-steps steps
MMAP_VARIABLE = "MALLOC_MMAP_THRESHOLD_"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, seq: int, comm: str, steps: int, queue, cap_bytes: int | None) -> None:
    """One rank of one mode: a few timed optimizer steps on random tokens (under an address-space
    cap where given: a failed allocation is reported as {"error": ...} instead)."""
    if cap_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))
    try:
        result = _train(rank, world, port, seq, comm, steps)
    except Exception as e:  # out of memory (also while importing), or the peer's failure seen in a collective
        result = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    if rank == 0 or "error" in result:
        queue.put(result)
        queue.close()
        queue.join_thread()
    # gloo's p2p threads can abort the interpreter's exit ("terminate called without an active
    # exception"), and a rank whose peer failed may wait in a collective: leave without teardown
    os._exit(0)


def _train(rank: int, world: int, port: int, seq: int, comm: str, steps: int) -> dict:
    import megazero
    from megazero import parallel_state
    from megazero.context_parallel.comm import exposed
    from models.llama import LlamaConfig
    from models.parallelize import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MEGAZERO_DIST_BACKEND="gloo")
    torch.set_num_threads(2 // world)  # the same 2 cores either way
    dist.init_process_group("gloo", rank=rank, world_size=world)
    grid = parallel_state.initialize_model_parallel(1, 1, 1, world)
    torch.manual_seed(0)
    config = LlamaConfig.from_json(os.path.join(REPO, "configs", "llama_cpu.json"), seq_length=seq, vocab_size=8000,
                                   context_parallel_size=world, cp_comm_type=comm)
    model = parallelize(config, grid)
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 8000, (seq + 1,), generator=generator) for _ in range(steps + 1)]
    data = [{"input_ids": s[:-1], "labels": s[1:]} for s in samples]
    engine, _, loader, _ = megazero.initialize(model=model, training_data=data, mpu=parallel_state, config={
        "train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 0}})
    batches = iter(loader)
    times, shares, losses = [], [], []
    for step in range(steps + 1):
        dist.barrier()
        start, blocked = time.perf_counter(), exposed.seconds
        loss = engine.train_batch(batches).detach().reshape(1)
        if step:  # the first step warms up
            times.append(time.perf_counter() - start)
            shares.append((exposed.seconds - blocked) / times[-1])
        dist.all_reduce(loss)  # each CP rank's loss is its tokens' mean: the sample's is their mean
        losses.append(loss.item() / world)
    measured = torch.tensor([float(engine.last_activation_bytes), statistics.median(shares) if shares else 0.0])
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    return {"step_s": statistics.median(times) if times else None, "activation_mib": measured[0].item() / 2**20,
            "exposed_share": measured[1].item(),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "losses": losses}


def measure(seq: int, world: int, comm: str, steps: int, cap_bytes: int | None = None,
            mmap_threshold: int = 0) -> dict:
    """One mode at one sequence length, in fresh processes (the first error any rank reports, under
    a cap; mmap_threshold > 0: glibc's, fixed, in bytes)."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_rank, args=(r, world, port, seq, comm, steps, queue, cap_bytes))
             for r in range(world)]
    with _environment({MMAP_VARIABLE: str(mmap_threshold)} if mmap_threshold else {}):
        for p in procs:  # glibc reads the variable when a process starts: the spawned ranks inherit it
            p.start()
    try:
        result = _result(queue, procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():  # waiting on a failed peer
                p.kill()
                p.join()
    if "error" in result:
        if cap_bytes is None:
            raise RuntimeError(f"seq {seq}, CP {world} ({comm}): {result['error']}")
        return result
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"seq {seq}, CP {world} ({comm}): a rank exited with "
                           f"{[p.exitcode for p in procs]}")
    if result["step_s"]:
        result["tokens_per_s"] = seq / result["step_s"]
    return result


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """os.environ with `values` set inside, restored after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _result(queue, procs, timeout: float = 3600) -> dict:
    """The first result a rank puts on the queue; an error if every rank has exited without one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=5)
        except Empty:
            if not any(p.is_alive() for p in procs):
                try:
                    return queue.get(timeout=1)
                except Empty:
                    return {"error": f"the ranks exited without a result: {[p.exitcode for p in procs]}"}
    return {"error": f"no result in {timeout} s"}


def longest(world: int, comm: str, cap_bytes: int, granule: int, start: int = 2048,
            mmap_threshold: int = 0) -> tuple[int, list]:
    """The longest sequence (a multiple of granule) whose step runs under the cap, and every try
    as (seq, fits)."""
    tries = []

    def fits(seq: int) -> bool:
        ok = "error" not in measure(seq, world, comm, 0, cap_bytes, mmap_threshold)
        tries.append((seq, ok))
        print(f"  cap: CP {world} ({comm}) seq {seq}: {'fits' if ok else 'out of memory'}", flush=True)
        return ok

    return search_longest(fits, start, granule), tries


def search_longest(fits, start: int, granule: int) -> int:
    """The largest multiple of granule n >= start with fits(n) (0 if start does not fit), assuming
    fits is monotone: doubling from start until a try fails, then bisecting."""
    if not fits(start):
        return 0
    good, bad = start, 2 * start
    while fits(bad):
        good, bad = bad, 2 * bad
    while bad - good > granule:
        middle = (good + bad) // 2 // granule * granule
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode (after one warm-up step)")
    parser.add_argument("--long-steps", type=int, default=1, help=f"timed steps beyond {LONG} tokens")
    parser.add_argument("--cap-gib", type=float, default=3.0,
                        help="per-rank address-space cap of the longest-sequence search (0: no search)")
    parser.add_argument("--granule", type=int, default=512, help="the longest sequence's resolution (tokens)")
    parser.add_argument("--search-start", type=int, default=2048, help="the longest-sequence search's first try")
    parser.add_argument("--mmap-threshold", type=int, default=2**20,
                        help="glibc's mmap threshold in the search's ranks, bytes (0: glibc's dynamic one)")
    parser.add_argument("--out", default=None, help="result file (default benchmarks/results/context.json)")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'seq':>6} {'mode':>8} {'s/step':>8} {'tokens/s':>9} {'act MiB':>9} {'RSS MiB':>8} "
          f"{'act x CP1':>9} {'tok/s x CP1':>11} {'exposed':>8}", flush=True)
    for seq in args.seq_lengths:
        base = None
        for name, world, comm in MODES:
            r = measure(seq, world, comm, args.steps if seq <= LONG else args.long_steps)
            base = base or r
            row = {"seq_length": seq, "mode": name, "step_s": round(r["step_s"], 3),
                   "tokens_per_s": round(r["tokens_per_s"], 1), "activation_mib": round(r["activation_mib"], 1),
                   "peak_rss_mib": round(r["peak_rss_mib"], 1),
                   "activation_vs_cp1": round(r["activation_mib"] / base["activation_mib"], 3),
                   "tokens_per_s_vs_cp1": round(r["tokens_per_s"] / base["tokens_per_s"], 3),
                   "exposed_comm_share": round(r["exposed_share"], 3),
                   "first_loss": round(r["losses"][0], 5)}
            rows.append(row)
            print(f"{seq:>6} {name:>8} {row['step_s']:>8.2f} {row['tokens_per_s']:>9.1f} "
                  f"{row['activation_mib']:>9.1f} {row['peak_rss_mib']:>8.1f} {row['activation_vs_cp1']:>9.3f} "
                  f"{row['tokens_per_s_vs_cp1']:>11.3f} {row['exposed_comm_share']:>8.3f}", flush=True)
    verdicts = []
    for row in rows:
        if row["mode"] != "cp1" and row["seq_length"] >= 8192:
            memory = "met" if row["activation_vs_cp1"] <= ACTIVATION_TARGET else "NOT met"
            speed = "met" if row["tokens_per_s_vs_cp1"] >= SPEED_TARGET else "NOT met"
            verdicts.append(f"seq {row['seq_length']} {row['mode']}: activations {row['activation_vs_cp1']:.2f}x CP1 "
                            f"(target <= {ACTIVATION_TARGET}: {memory}), tokens/s {row['tokens_per_s_vs_cp1']:.2f}x "
                            f"(target >= {SPEED_TARGET}: {speed}), communication exposed "
                            f"{100 * row['exposed_comm_share']:.1f}% of the step")
    longest_rows = []
    if args.cap_gib:
        cap = int(args.cap_gib * 2**30)
        for name, world, comm in MODES:
            seq, tries = longest(world, comm, cap, args.granule, args.search_start, args.mmap_threshold)
            longest_rows.append({"mode": name, "cap_gib": args.cap_gib, "mmap_threshold": args.mmap_threshold,
                                 "longest_seq": seq, "tries": tries,
                                 "vs_cp1": round(seq / longest_rows[0]["longest_seq"], 3) if longest_rows else 1.0})
        for row in longest_rows:
            print(f"under {args.cap_gib} GiB per rank: {row['mode']:>8} trains {row['longest_seq']} tokens "
                  f"({row['vs_cp1']:.2f}x CP1)", flush=True)
            if row["mode"] != "cp1":
                met = "met" if row["vs_cp1"] >= LONGEST_TARGET else "NOT met"
                verdicts.append(f"longest sequence under {args.cap_gib} GiB per rank, {row['mode']}: "
                                f"{row['vs_cp1']:.2f}x CP1 (target >= {LONGEST_TARGET}: {met})")
    for line in verdicts:
        print(line)
    result = {"rows": rows, "longest": longest_rows, "verdicts": verdicts}
    write_result("context", result, args=args, argv=argv, out=args.out)
    return result


if __name__ == "__main__":
    main()
