"""Context parallelism against one process on long sequences: the CPU Llama (configs/llama_cpu.json)
at each sequence length, one sample per step, run as CP=1 (one process, both cores) and CP=2 (two
gloo ranks, one core each) with ring (p2p) and all-to-all (a2a) attention, one after another in
one run: the activations each rank keeps for backward (engine.last_activation_bytes), its peak RSS
and tokens/s, with the CP=2 / CP=1 ratios.

    python benchmarks/bench_context.py [--seq-lengths 2048 4096 8192] [--steps 3]

Targets (issue 38): activations per rank at CP=2 <= 0.55x CP=1's at 8k and beyond; CP=2 tokens/s
>= 0.9x CP=1's at 8k.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.record import REPO, write_result

MODES = [("cp1", 1, "p2p"), ("cp2_p2p", 2, "p2p"), ("cp2_a2a", 2, "a2a")]
ACTIVATION_TARGET, SPEED_TARGET = 0.55, 0.9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, seq: int, comm: str, steps: int, queue) -> None:
    """One rank of one mode: a few timed optimizer steps on random tokens."""
    import megazero
    from megazero import parallel_state
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
    times, losses = [], []
    for step in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        loss = engine.train_batch(batches).detach().reshape(1)
        if step:  # the first step warms up
            times.append(time.perf_counter() - start)
        dist.all_reduce(loss)  # each CP rank's loss is its tokens' mean: the sample's is their mean
        losses.append(loss.item() / world)
    activations = torch.tensor([float(engine.last_activation_bytes)])
    dist.all_reduce(activations, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put({"step_s": statistics.median(times), "activation_mib": activations.item() / 2**20,
                   "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "losses": losses})
        queue.close()
        queue.join_thread()
    dist.destroy_process_group()
    # gloo's p2p threads can abort the interpreter's exit ("terminate called without an active
    # exception"): the result is delivered, so leave without the C++ destructors
    os._exit(0)


def measure(seq: int, world: int, comm: str, steps: int) -> dict:
    """One mode at one sequence length, in fresh processes."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_rank, args=(r, world, port, seq, comm, steps, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=3600)
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"seq {seq}, CP {world} ({comm}): rank exited with {p.exitcode}")
    result["tokens_per_s"] = seq / result["step_s"]
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode (after one warm-up step)")
    parser.add_argument("--out", default=None, help="result file (default benchmarks/results/context.json)")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'seq':>6} {'mode':>8} {'s/step':>8} {'tokens/s':>9} {'act MiB':>9} {'RSS MiB':>8} "
          f"{'act x CP1':>9} {'tok/s x CP1':>11}", flush=True)
    for seq in args.seq_lengths:
        base = None
        for name, world, comm in MODES:
            r = measure(seq, world, comm, args.steps)
            base = base or r
            row = {"seq_length": seq, "mode": name, "step_s": round(r["step_s"], 3),
                   "tokens_per_s": round(r["tokens_per_s"], 1), "activation_mib": round(r["activation_mib"], 1),
                   "peak_rss_mib": round(r["peak_rss_mib"], 1),
                   "activation_vs_cp1": round(r["activation_mib"] / base["activation_mib"], 3),
                   "tokens_per_s_vs_cp1": round(r["tokens_per_s"] / base["tokens_per_s"], 3),
                   "first_loss": round(r["losses"][0], 5)}
            rows.append(row)
            print(f"{seq:>6} {name:>8} {row['step_s']:>8.2f} {row['tokens_per_s']:>9.1f} "
                  f"{row['activation_mib']:>9.1f} {row['peak_rss_mib']:>8.1f} {row['activation_vs_cp1']:>9.3f} "
                  f"{row['tokens_per_s_vs_cp1']:>11.3f}", flush=True)
    verdicts = []
    for row in rows:
        if row["mode"] != "cp1" and row["seq_length"] >= 8192:
            memory = "met" if row["activation_vs_cp1"] <= ACTIVATION_TARGET else "NOT met"
            speed = "met" if row["tokens_per_s_vs_cp1"] >= SPEED_TARGET else "NOT met"
            verdicts.append(f"seq {row['seq_length']} {row['mode']}: activations {row['activation_vs_cp1']:.2f}x CP1 "
                            f"(target <= {ACTIVATION_TARGET}: {memory}), tokens/s {row['tokens_per_s_vs_cp1']:.2f}x "
                            f"(target >= {SPEED_TARGET}: {speed})")
    for line in verdicts:
        print(line)
    result = {"rows": rows, "verdicts": verdicts}
    write_result("context", result, args=args, argv=argv, out=args.out)
    return result


if __name__ == "__main__":
    main()
