"""The cost of optimizer offload to NVMe: step time of megazero ZeRO-1/2/3 with
`offload_optimizer.device: nvme` next to the same stage in memory, on a GPT that fits in memory,
side by side in one run, and the aio op's bandwidth during it next to `dd` with direct I/O on the
same file system. With --param-offload, stage 3 only: in memory, parameter offload to NVMe
(`offload_param.device: nvme`, max_in_cpu 0: every partition read back for each use) and both
offloads, the same way (ratios to in-memory stage 3), on --dp ranks (default 1; the same tokens
per step); --breakdown then adds each engine's phases and its waits on the parameter and optimizer
swap files by phase (benchmarks/results/param_offload[_dp<N>].json). --param-memory (stage 3,
DP=1, max_in_cpu 0): what parameter offload keeps in memory, in memory / offloaded / offloaded and
built under zero.Init onto NVMe, each in a fresh process: the non-persistent partitions in memory
at the peak of forward and backward and of the update, between steps, the pool's buffers, the RSS
growth while the model is built and the peak RSS of the steps
(benchmarks/results/param_offload_memory.json).

One process (one gloo rank, the machine's threads), bf16, AdamW (megazero's CPU op), the same
data and initial weights for every configuration. All six engines live in the process and take
turns (alternating trials of a few steps), so machine noise hits all alike; medians of step time
and of per-trial ratios offloaded / in-memory (target: <= 1.3). The bandwidth the run saw: over the
timed trials of an offloaded engine, the bytes its swap files read (masters, optimizer states and,
at stages 2-3, gradients) over the seconds during which at least one read chunk was in flight in
the aio op, and the same for writes (the op's own clock, AsyncIO.busy_seconds(): I/O overlaps
compute, so the step time is not the I/O time; reads and writes also overlap each other and share
the disk). "I/O busy" is the share of the step time during which any chunk was in flight. After the
run every sub-group file is read and written once more, alone, for the op's own read and write
GB/s, next to `dd` (4 MiB blocks, oflag/iflag=direct) on the same directory. --tokens adds the
tokens per step. --breakdown adds each engine's ms per step in forward, backward, reduce and the
optimizer step (the engine's timers) and, offloaded, its waits on the aio op in each. Writes
benchmarks/results/offload.json.

Offload's cost falls as tokens per step grow (compute grows with them, the swap I/O does not):
--tokens-per-step 512 1024 2048 runs the comparison at each, by a larger micro-batch and by
gradient accumulation of --batch micro-batches (at stages 2-3 each micro-batch's reduced
gradients are added to the evicted ones: more gradient I/O than one larger micro-batch), and
prints the ratios side by side (benchmarks/results/offload_sweep.json).

    python benchmarks/bench_offload.py --nvme-path /local_nvme
    python benchmarks/bench_offload.py --tokens-per-step 512 1024 2048
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import resource
import statistics
import subprocess
import tempfile
import time

import torch
import torch.distributed as dist

import megazero
from benchmarks.record import write_result
from megazero.data import GPTDataset, IndexedDataset
from models.gpt import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STAGES = (1, 2, 3)
# --param-offload: stage 3's rows, by what is offloaded
PARAM_KINDS = ("param", "both")


def _engine(args, stage: int, offload, prefix: str, micro_batch: int | None = None, accumulation: int = 1,
            under_init: bool = False, after_model=None):
    """(engine, batch iterator) of this config; `under_init`: the model built under zero.Init with it
    (straight into swap files when parameters are offloaded to nvme); `after_model()` is called once
    the model is built, before the engine."""
    micro_batch = micro_batch or args.batch
    zero = {"stage": stage, "reduce_bucket_size": args.bucket, "sub_group_size": args.sub_group_size}
    if offload in (True, "both"):
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": args.nvme_path}
    if offload in ("param", "both"):
        zero["offload_param"] = {"device": "nvme", "nvme_path": args.nvme_path, "max_in_cpu": 0}
    world = dist.get_world_size()
    config = {"train_batch_size": micro_batch * accumulation * world, "train_micro_batch_size_per_gpu": micro_batch,
              "gradient_accumulation_steps": accumulation, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero,
              "steps_per_print": 10**9, "wall_clock_breakdown": getattr(args, "breakdown", False)}
    megazero.set_seed(0)
    with megazero.zero.Init(config_dict_or_path=config, enabled=under_init):
        model = GPT(GPTConfig(vocab_size=args.vocab, seq_length=args.seq, num_layers=args.layers,
                              hidden_size=args.hidden, num_attention_heads=args.heads, dropout=0.0))
    if after_model is not None:
        after_model()
    dataset = GPTDataset(IndexedDataset(prefix), args.seq, seed=0)
    engine, _, loader, _ = megazero.initialize(model=model, training_data=dataset, config=config)
    return engine, iter(loader)


def _timed_offload_pass(engine) -> dict:
    """Accumulate the wall time of the offloaded optimizer pass (the sub-group loop)."""
    clock = {"seconds": 0.0}
    inner_step = engine.dp.step

    def step(*a, **k):
        start = time.perf_counter()
        inner_step(*a, **k)
        clock["seconds"] += time.perf_counter() - start

    engine.dp.step = step
    return clock


PHASES = ("forward", "backward", "backward_reduce", "optimizer")


def _in_phase(timer, method, phase: str):
    """`method`, setting `timer._phase` to `phase` while it runs (then back to forward/backward), so
    that the aio waits inside it are charged to that phase."""
    def run(*a, **k):
        timer._phase = phase
        try:
            return method(*a, **k)
        finally:
            timer._phase = "fwd_bwd"

    return run


class _IOWaits:
    """Seconds an offloaded engine spent blocked in the aio op's wait(), by where it waited: in
    forward and backward (gradient writes: a free buffer), in reduce_gradients (the last gradient
    writes), in the optimizer step (reads of masters, moments and gradients)."""

    def __init__(self, engine):
        self.seconds = {"fwd_bwd": 0.0, "reduce": 0.0, "step": 0.0}
        self._phase = "fwd_bwd"
        state, files = engine.dp, engine.dp.files
        inner_wait = files.wait

        def wait(*a, **k):
            start = time.perf_counter()
            try:
                return inner_wait(*a, **k)
            finally:
                self.seconds[self._phase] += time.perf_counter() - start

        files.wait = wait
        for name, phase in (("reduce_gradients", "reduce"), ("step", "step")):
            setattr(state, name, _in_phase(self, getattr(state, name), phase))

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def _print_breakdown(engines: dict, names: list, waits: dict, steps: int) -> None:
    """ms per step of each engine phase (the engine's timers) and, offloaded, of waits on I/O."""
    print(f"{'engine':<14}" + "".join(f"{p:>17}" for p in PHASES)
          + f"{'I/O wait fwd+bwd':>18}{'reduce':>8}{'step':>8}  (ms per step)")
    for n in names:
        means = engines[n][0].timers.means_ms(list(PHASES))
        label = f"stage {n[0]} {'nvme' if n[1] else 'mem'}"
        line = f"{label:<14}" + "".join(f"{means[p]:>17.1f}" for p in PHASES)
        if n in waits:
            w = {k: 1000 * v / steps for k, v in waits[n].seconds.items()}
            line += f"{w['fwd_bwd']:>18.1f}{w['reduce']:>8.1f}{w['step']:>8.1f}"
        print(line)


def _dd(path: str, megabytes: int) -> dict:
    """dd's direct-I/O write and read GB/s of `megabytes` MiB in `path` (None where it fails)."""
    target = os.path.join(path, "megazero-bench-dd")
    out = {}
    for name, cmd in (("write", ["dd", "if=/dev/zero", f"of={target}", "bs=4M", f"count={megabytes // 4}",
                                 "oflag=direct", "conv=fsync"]),
                      ("read", ["dd", f"if={target}", "of=/dev/null", "bs=4M", "iflag=direct"])):
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True)
        seconds = time.perf_counter() - start
        out[name] = megabytes * 2**20 / seconds / 1e9 if done.returncode == 0 else None
    if os.path.exists(target):
        os.remove(target)
    return out


def _op_alone(engine) -> dict:
    """Read, then write, every sub-group file once with the op, nothing else running: GB/s."""
    state = engine.dp
    state.finish_io()  # the last step's write-backs and early reads
    files, nbytes = state.files, 0
    buffers = []
    start = time.perf_counter()
    for sg in state.groups:
        from megazero.ops.aio import aligned_empty

        buffer = aligned_empty((sg.kinds_saved * sg.padded,), torch.float32)
        buffers.append((sg, buffer, files.submit_read(sg.name, buffer)))
        nbytes += buffer.numel() * 4
    files.wait()
    read = nbytes / (time.perf_counter() - start) / 1e9
    start = time.perf_counter()
    for sg, buffer, _ in buffers:
        files.submit_write(sg.name, buffer)
    files.wait()
    os.sync()
    write = nbytes / (time.perf_counter() - start) / 1e9
    return {"read": read, "write": write, "bytes": nbytes}


def _alternating_trials(engines: dict, names: list, args) -> dict:
    """Seconds per step of each engine in each trial, the engines taking turns (a load spike hits all)."""
    times = {n: [] for n in names}
    for _ in range(args.trials):
        for n in names:
            engine, data = engines[n]
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.train_batch(data)
            times[n].append((time.perf_counter() - start) / args.steps)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--bucket", type=int, default=5_000_000)
    parser.add_argument("--sub-group-size", type=int, default=10_000_000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--param-offload", action="store_true",
                        help="stage 3 only: in memory, parameter offload, both offloads")
    parser.add_argument("--param-memory", action="store_true",
                        help="stage 3, DP=1: partition bytes and RSS in memory, with parameter offload, and built "
                             "under zero.Init onto NVMe, each in a fresh process")
    parser.add_argument("--dp", type=int, default=1,
                        help="--param-offload: data-parallel ranks (processes), micro-batch --batch / --dp each")
    parser.add_argument("--deepspeed", action="store_true",
                        help="DP=2, ZeRO-3 + optimizer and parameter offload: megazero against DeepSpeed")
    parser.add_argument("--ds-device", choices=("auto", "nvme", "cpu"), default="auto",
                        help="--deepspeed: the offload device of both (auto: nvme where DeepSpeed's async_io loads)")
    parser.add_argument("--steps", type=int, default=2, help="steps per trial")
    parser.add_argument("--breakdown", action="store_true",
                        help="per engine: ms per step of forward, backward, reduce, optimizer, and waits on I/O")
    parser.add_argument("--tokens-per-step", type=int, nargs="+", default=[],
                        help="sweep: each tokens/step (multiples of batch x seq) by a larger micro-batch and by "
                             "gradient accumulation of --batch micro-batches, ratios per stage")
    parser.add_argument("--sweep", nargs="+", choices=("micro-batch", "accumulation"),
                        default=["micro-batch", "accumulation"], help="--tokens-per-step: the ways to get them")
    parser.add_argument("--tokens", action="store_true", help="add tokens/s columns (tokens per step: batch x seq)")
    parser.add_argument("--prefix", default=os.path.join(REPO, "data", "gpt2", "shakespeare_train_text_document"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "offload.json"))
    args = parser.parse_args(argv)
    if args.deepspeed:
        return _deepspeed(args)
    if args.param_memory:
        return _param_memory(args)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(minutes=30))
    if args.param_offload:
        if args.batch % args.dp:
            raise SystemExit(f"--dp {args.dp}: --batch {args.batch} is not a multiple of it")
        return _param_offload(args)
    if not args.tokens_per_step:
        _cost(args, args.batch, 1, args.out, full=True)
    else:  # each tokens/step by a larger micro-batch and, above one micro-batch, by accumulation
        sweep = []
        base = args.batch * args.seq
        for tokens in args.tokens_per_step:
            if tokens % base:
                raise SystemExit(f"--tokens-per-step {tokens}: not a multiple of --batch x --seq = {base}")
            ways = []
            if tokens == base or "micro-batch" in args.sweep:
                ways.append(("micro-batch", tokens // args.seq, 1))
            if tokens > base and "accumulation" in args.sweep:
                ways.append(("accumulation", args.batch, tokens // base))
            for way, micro, accumulation in ways:
                out = args.out.replace(".json", f"_{tokens}_{way}.json")
                rows = _cost(args, micro, accumulation, out, full=tokens == base and way == "micro-batch")
                sweep += [{"tokens_per_step": tokens, "by": way, "micro_batch": micro,
                           "accumulation": accumulation, **r} for r in rows]
        _print_sweep(sweep)
        out = args.out.replace(".json", "_sweep.json")
        write_result(os.path.basename(out)[:-5], {"rows": sweep}, args=args, argv=argv, out=out)
    dist.destroy_process_group()


def _print_sweep(sweep: list[dict]) -> None:
    """One line per tokens/step and way: the offloaded / in-memory ratio of each stage."""
    load = os.getloadavg()
    print(f"\nsweep (load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}): offload / in memory, "
          f"median of per-trial ratios (in-memory s/step)")
    print(f"{'tokens/step':<13}{'by':<14}" + "".join(f"{'stage ' + str(s):>18}" for s in STAGES))
    keys = sorted({(r["tokens_per_step"], r["by"]) for r in sweep})
    for tokens, way in keys:
        cells = {r["stage"]: r for r in sweep if (r["tokens_per_step"], r["by"]) == (tokens, way)}
        print(f"{tokens:<13}{way:<14}" + "".join(f"{cells[s]['ratio']:>9.2f} ({cells[s]['in_memory_s']:.3f})"
                                                 for s in STAGES))


def _cost(args, micro_batch: int, accumulation: int, out: str, full: bool) -> list[dict]:
    """In-memory and NVMe-offloaded engines of every stage at this micro-batch and accumulation,
    alternating trials; one row per stage (printed). `full`: also the op alone and dd, and the json."""
    names = [(s, o) for s in STAGES for o in (False, True)]
    engines = {n: _engine(args, *n, args.prefix, micro_batch, accumulation) for n in names}
    clocks = {n: _timed_offload_pass(engines[n][0]) for n in names if n[1]}
    waits = {n: _IOWaits(engines[n][0]) for n in names if n[1]} if args.breakdown else {}
    for engine, data in engines.values():  # warm-up: the first step makes the optimizer states
        engine.train_batch(data)
        engine.timers.means_ms(list(PHASES))  # (reset)
    for w in waits.values():
        w.reset()
    busy0 = {}
    for n in clocks:
        clocks[n]["seconds"] = 0.0
        engines[n][0].dp.finish_io()
        engines[n][0].dp.files.bytes_read = engines[n][0].dp.files.bytes_written = 0
        busy0[n] = engines[n][0].dp.files.aio.busy_seconds()
    times = _alternating_trials(engines, names, args)
    busy = {}
    for n in clocks:
        engines[n][0].dp.finish_io()  # (bytes counted at submission: the last step's I/O included)
        now = engines[n][0].dp.files.aio.busy_seconds()
        busy[n] = {k: now[k] - busy0[n][k] for k in now}
    psi = sum(s.numel() for s in engines[names[0]][0].dp.parameter_shapes().values())
    rows = []
    for stage in STAGES:
        plain, off = times[(stage, False)], times[(stage, True)]
        files, b = engines[(stage, True)][0].dp.files, busy[(stage, True)]
        steps = args.trials * args.steps
        rows.append({"stage": stage, "in_memory_s": statistics.median(plain), "offloaded_s": statistics.median(off),
                     "ratio": statistics.median([o / p for o, p in zip(off, plain)]),
                     "run_read_GBps": files.bytes_read / b["read"] / 1e9,
                     "run_write_GBps": files.bytes_written / b["write"] / 1e9,
                     "read_MB_per_step": files.bytes_read / steps / 1e6,
                     "write_MB_per_step": files.bytes_written / steps / 1e6,
                     "io_busy_share": b["any"] / sum(off) / args.steps,
                     "optimizer_pass_s": clocks[(stage, True)]["seconds"] / steps,
                     "swap_bytes": files.disk_bytes()})
    if args.breakdown:
        _print_breakdown(engines, names, waits, args.trials * args.steps)
    alone = _op_alone(engines[(3, True)][0]) if full else None
    dd = _dd(args.nvme_path, max(64, alone["bytes"] // 2**20)) if full else None
    print(f"GPT {psi / 1e6:.1f} M parameters, bf16, AdamW; swap files in {args.nvme_path} "
          f"(op backend {engines[(3, True)][0].dp.files.aio.backend}); sub_group_size {args.sub_group_size:,}")
    load = os.getloadavg()
    tokens = micro_batch * accumulation * args.seq
    print(f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}; {tokens} tokens per step "
          f"(micro-batch {micro_batch} x {args.seq} tokens, accumulation {accumulation})")
    print(f"{'stage':<7}{'in memory s/step':>18}{'nvme offload s/step':>21}{'ratio':>8}"
          f"{'read GB/s in run':>18}{'write GB/s in run':>19}{'MB read/written per step':>26}{'I/O busy':>10}"
          + (f"{'tokens/s mem / nvme':>21}" if args.tokens else ""))
    for r in rows:
        print(f"{r['stage']:<7}{r['in_memory_s']:>18.3f}{r['offloaded_s']:>21.3f}{r['ratio']:>8.2f}"
              f"{r['run_read_GBps']:>18.2f}{r['run_write_GBps']:>19.2f}"
              f"{r['read_MB_per_step']:>15.0f} / {r['write_MB_per_step']:<8.0f}{r['io_busy_share']:>10.0%}"
              + (f"{tokens / r['in_memory_s']:>13.0f} / {tokens / r['offloaded_s']:<6.0f}" if args.tokens else ""))
    if full:
        print(f"op alone on the swap files: read {alone['read']:.2f} GB/s, write {alone['write']:.2f} GB/s; "
              f"dd direct I/O: read {dd['read'] or float('nan'):.2f} GB/s, "
              f"write {dd['write'] or float('nan'):.2f} GB/s")
    write_result(os.path.basename(out)[:-5], {"num_params": psi, "rows": rows, "op_alone": alone, "dd": dd},
                 args=args, out=out)
    for engine, _ in engines.values():
        if hasattr(engine.dp, "close"):
            engine.dp.close()
    return rows




def _param_offload(args) -> None:
    """Stage 3 in memory, with parameter offload, with both offloads: alternating trials, as main(),
    on --dp ranks (each with a micro-batch of --batch / --dp: the same tokens per step)."""
    names = [False, *PARAM_KINDS]
    if args.dp == 1:
        result = _param_offload_trials(args, names)
    else:
        dist.destroy_process_group()
        from benchmarks.bench_zero import spawn_workers

        (result,) = spawn_workers(_param_offload_worker, (args, names), args.dp, 1)
    times = {n: result["times"][str(n)] for n in names}
    rows = [{"offload": n or "none", "s_per_step": statistics.median(times[n]),
             "ratio": statistics.median([o / p for o, p in zip(times[n], times[False])])} for n in names]
    load = os.getloadavg()
    print(f"GPT {result['num_params'] / 1e6:.1f} M parameters, bf16, AdamW, stage 3, DP={args.dp} "
          f"(micro-batch {args.batch // args.dp} per rank); swap files in {args.nvme_path}; "
          f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")
    print(f"{'offload':<9}{'s/step':>10}{'/ in memory':>13}")
    for r in rows:
        print(f"{r['offload']:<9}{r['s_per_step']:>10.3f}{r['ratio']:>13.2f}")
    if args.breakdown:
        _print_param_breakdown(result["breakdown"])
    suffix = "" if args.dp == 1 else f"_dp{args.dp}"
    out = args.out.replace("offload.json", f"param_offload{suffix}.json")
    write_result(os.path.basename(out)[:-5], {"num_params": result["num_params"], "rows": rows,
                                              "breakdown": result.get("breakdown")}, args=args, out=out)
    if args.dp == 1:
        dist.destroy_process_group()


def _param_offload_worker(rank: int, world: int, port: int, args, names: list, queue) -> None:
    from benchmarks.bench_zero import init_process

    init_process(rank, world, port)
    result = _param_offload_trials(args, names)
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


class _ParamWaits:
    """Seconds an engine spent blocked on each of its swap files' aio waits (parameter files,
    optimizer files), by where: forward and backward, the optimizer step (where stage 3 with both
    offloads also casts the masters into the parameter partitions and writes them back),
    update_model (parameter offload alone: the casts and write-backs)."""

    def __init__(self, engine):
        self.seconds: dict[str, float] = {}
        self._phase = "fwd_bwd"
        state = engine.dp
        inner = getattr(state, "inner", state)
        files = {"param": getattr(getattr(inner, "param_swap", None), "files", None),
                 "optimizer": getattr(state, "files", None)}
        for label, f in files.items():
            if f is not None:
                f.wait = self._timed(f.wait, label)
        for name in ("step", "update_model"):  # (step: the offloaded optimizer's sub-group loop)
            if hasattr(state, name):
                setattr(state, name, _in_phase(self, getattr(state, name), name))

    def _timed(self, wait, label: str):
        def run(*a, **k):
            start = time.perf_counter()
            try:
                return wait(*a, **k)
            finally:
                key = f"{label} in {self._phase}"
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start

        return run


def _param_offload_trials(args, names: list) -> dict:
    """This rank's engines, warm-up and alternating trials (a barrier before each at DP > 1)."""
    world = dist.get_world_size()
    engines = {n: _engine(args, 3, n, args.prefix, micro_batch=args.batch // world) for n in names}
    waits = {n: _ParamWaits(engines[n][0]) for n in names} if args.breakdown else {}
    for engine, data in engines.values():  # warm-up: the first step makes the optimizer states
        engine.train_batch(data)
        engine.timers.means_ms(list(PHASES))  # (reset)
    for w in waits.values():
        w.seconds.clear()
    times = {n: [] for n in names}
    for _ in range(args.trials):
        for n in names:
            engine, data = engines[n]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.train_batch(data)
            times[n].append((time.perf_counter() - start) / args.steps)
    steps = args.trials * args.steps
    breakdown = {str(n): {**engines[n][0].timers.means_ms(list(PHASES)),
                          **({k: 1000 * v / steps for k, v in waits[n].seconds.items()} if waits else {})}
                 for n in names} if args.breakdown else None
    psi = sum(s.numel() for s in engines[False][0].dp.parameter_shapes().values())
    for engine, _ in engines.values():
        if hasattr(engine.dp, "close"):
            engine.dp.close()
    return {"times": {str(n): t for n, t in times.items()}, "breakdown": breakdown, "num_params": psi}


def _print_param_breakdown(breakdown: dict) -> None:
    """ms per step of each engine phase and of its waits on the swap files (rank 0)."""
    waits = sorted({k for b in breakdown.values() for k in b if k not in PHASES})
    print("ms per step (rank 0): " + ", ".join(PHASES) + "; waits on the aio op: " + ", ".join(waits))
    for n, b in breakdown.items():
        label = {"False": "none"}.get(n, n)
        print(f"{label:<9}" + "".join(f"{b[p]:>9.1f}" for p in PHASES) + " |"
              + "".join(f"{b.get(k, 0.0):>9.1f}" for k in waits))


# ---- --param-memory: what parameter offload keeps in memory ----------------------------------------
# (kind, offload, built under zero.Init)
MEMORY_KINDS = (("in memory", False, False), ("param offload", "param", False),
                ("param offload, zero.Init", "param", True))


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _reset_peak_rss() -> bool:
    """Start VmHWM (peak RSS) anew from the current RSS (Linux: clear_refs 5); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _param_memory_worker(rank: int, world: int, port: int, args, kind: tuple, queue) -> None:
    """One fresh process: the model's build (peak RSS growth while it is built), a warm-up step, then trials x steps
    steps measured: the non-persistent partitions in memory at the peak (offloaded: the swapper's
    count of partitions in memory, in pool buffers or their own), the pool's allocated buffers, the
    partitions in memory between steps, and the peak RSS of the steps."""
    from benchmarks.bench_zero import init_process

    init_process(rank, world, port)
    name, offload, under_init = kind
    rss0 = _status_kib("VmRSS")
    resettable = _reset_peak_rss()
    peaks = []
    engine, data = _engine(args, 3, offload, args.prefix, under_init=under_init,
                           after_model=lambda: peaks.append(_status_kib("VmHWM")))
    build_peak = peaks[0] if resettable else None
    state = engine.dp
    inner = getattr(state, "inner", state)
    swap = inner.param_swap
    element = inner.parts[0].shard.element_size()
    split = [s for s in inner.parts if not s.persistent]
    persistent = sum(s.shard.numel() * s.shard.element_size() for s in inner.parts if s.persistent)
    engine.train_batch(data)  # warm-up: optimizer states
    phases = {"fwd_bwd": 0, "update": 0}  # peak partition elements in memory, by phase
    buffers = dict(phases)  # peak pool buffers in use, by phase
    if swap is not None:
        inner_update = inner.update_model

        def note(phase: str) -> None:
            phases[phase] = max(phases[phase], swap.peak_resident_numel)
            buffers[phase] = max(buffers[phase], swap.pool.peak_in_use)
            swap.reset_peak()

        def update_model(*a, **k):  # the casts and write-backs of the updated partitions
            note("fwd_bwd")
            try:
                return inner_update(*a, **k)
            finally:
                note("update")

        inner.update_model = update_model
        swap.reset_peak()
    _reset_peak_rss()
    rss_steps0 = _status_kib("VmRSS")
    for _ in range(args.trials * args.steps):
        engine.train_batch(data)
    out = {"kind": name, "num_params": sum(s.numel() for s in state.parameter_shapes().values()),
           "partitions_MiB": sum(s.shard.numel() for s in split) * element / 2**20,
           "persistent_MiB": persistent / 2**20,
           "build_rss_growth_MiB": (build_peak - rss0) / 1024 if build_peak is not None else None,
           "steps_rss_start_MiB": rss_steps0 / 1024, "steps_peak_rss_MiB": _status_kib("VmHWM") / 1024}
    if swap is not None:
        out.update(partitions_MiB=max(phases.values()) * element / 2**20,
                   fwd_bwd_partitions_MiB=phases["fwd_bwd"] * element / 2**20,
                   update_partitions_MiB=phases["update"] * element / 2**20,
                   between_steps_MiB=swap.resident_numel * element / 2**20,
                   pool_MiB=swap.pool.made * swap.pool.nbytes / 2**20, pool_buffers=swap.pool.made,
                   pool_peak_in_use=f"{buffers['fwd_bwd']} / {buffers['update']}", pool_overflows=swap.pool.overflows,
                   largest_partition_MiB=max(s.shard.numel() for s in split) * element / 2**20)
        swap.close()
    else:
        out.update(between_steps_MiB=out["partitions_MiB"], fwd_bwd_partitions_MiB=out["partitions_MiB"],
                   update_partitions_MiB=out["partitions_MiB"])
    if hasattr(state, "close"):
        state.close()
    queue.put(out)
    dist.destroy_process_group()


def _param_memory(args) -> None:
    """--param-memory: each kind of MEMORY_KINDS in a fresh process, one after the other (printed, json)."""
    from benchmarks.bench_zero import spawn_workers

    # as benchmarks/largest_model.py: freed large buffers go back to the system, so RSS measures what is held
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")
    rows = [spawn_workers(_param_memory_worker, (args, kind), 1, 1)[0] for kind in MEMORY_KINDS]
    load = os.getloadavg()
    print(f"GPT {rows[0]['num_params'] / 1e6:.1f} M parameters, bf16, AdamW, stage 3, DP=1, max_in_cpu 0, "
          f"{args.trials * args.steps} steps measured after one; swap files in {args.nvme_path}; "
          f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")
    print(f"{'kind':<27}{'partitions MiB: fwd+bwd / update peak':>38}{'between steps':>15}{'persistent':>12}"
          f"{'pool MiB':>10}{'buffers made, peak used fwd+bwd / update':>43}{'RSS growth model build':>24}"
          f"{'peak RSS in steps':>19}")
    for r in rows:
        pool = (f"{r['pool_MiB']:>10.1f}{r['pool_buffers']:>22}, {r['pool_peak_in_use']:<19}"
                if "pool_MiB" in r else f"{'-':>10}{'-':>43}")
        growth = f"{r['build_rss_growth_MiB']:>24.1f}" if r["build_rss_growth_MiB"] is not None else f"{'-':>24}"
        peak = f"{r['fwd_bwd_partitions_MiB']:.2f} / {r['update_partitions_MiB']:.2f}"
        print(f"{r['kind']:<27}{peak:>38}{r['between_steps_MiB']:>15.2f}{r['persistent_MiB']:>12.2f}"
              + pool + growth + f"{r['steps_peak_rss_MiB']:>19.0f}")
    pooled = [r for r in rows if "pool_MiB" in r]
    if pooled:
        largest = pooled[0]["largest_partition_MiB"]
        print(f"pool: buffer_count buffers, each the largest partition's bytes ({largest:.2f} MiB);"
              f" partitions given memory of their own (every buffer in use): "
              f"{', '.join(str(r['pool_overflows']) for r in pooled)}")
    out = args.out.replace("offload.json", "param_offload_memory.json")
    write_result(os.path.basename(out)[:-5], {"rows": rows}, args=args, out=out)


# ---- --deepspeed: megazero against DeepSpeed, DP=2 -------------------------------------------------
DS_WORLD = 2


def _ds_config(args, device: str) -> dict:
    """The engine config both get: ZeRO-3, optimizer and parameters offloaded to `device`."""
    nvme = {"nvme_path": args.nvme_path} if device == "nvme" else {}
    return {"train_micro_batch_size_per_gpu": args.batch // DS_WORLD, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": args.bucket, "sub_group_size": args.sub_group_size,
                                  "offload_optimizer": {"device": device, **nvme},
                                  # DeepSpeed holds a buffer per partitioned parameter fetched or prefetched
                                  # (its default 5 failed here: "Not enough buffers 0 for swapping 1"):
                                  # enough for every weight of this small model, each the largest one's size
                                  "offload_param": {"device": device, **nvme, "buffer_count": 6 * args.layers + 4,
                                                    "buffer_size": max(args.vocab, 4 * args.hidden) * args.hidden,
                                                    "max_in_cpu": 0}},
            "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                    "overlap_events": True},
            "steps_per_print": 10**9}


class _Runner:
    """megazero's or DeepSpeed's engine over this rank's micro-batches, the DeepSpeed loop."""

    def __init__(self, args, kind: str, device: str):
        megazero.set_seed(0)
        model = GPT(GPTConfig(vocab_size=args.vocab, seq_length=args.seq, num_layers=args.layers,
                              hidden_size=args.hidden, num_attention_heads=args.heads, dropout=0.0))
        config = _ds_config(args, device)
        if kind == "deepspeed":
            import deepspeed

            deepspeed.utils.logger.setLevel(logging.WARNING)
            self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        else:
            self.engine, *_ = megazero.initialize(model=model, config=config)
        from megazero.data import DistributedBatchLoader

        dataset = GPTDataset(IndexedDataset(args.prefix), args.seq, seed=0)
        self.data = iter(DistributedBatchLoader(dataset, args.batch // DS_WORLD, dist.get_rank(), DS_WORLD))

    def step(self) -> float:
        batch = next(self.data)
        loss = self.engine(batch["input_ids"], batch["labels"])
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()


def _ds_device(args) -> tuple[str, str | None]:
    """'nvme', or 'cpu' and why DeepSpeed's NVMe offload cannot run here (its async_io op)."""
    try:
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("AsyncIOBuilder")
        if builder is None:
            return "cpu", f"accelerator {get_accelerator()._name!r} has no AsyncIOBuilder"
        if not builder.is_compatible(verbose=False):
            return "cpu", "async_io is not compatible (libaio's .so and headers missing: apt-get install libaio-dev)"
        builder.load(verbose=False)
    except Exception as e:  # the op's build error, verbatim
        return "cpu", f"{type(e).__name__}: {e}"
    return "nvme", None


def _ds_throughput(rank: int, world: int, port: int, args, device: str, queue) -> None:
    from benchmarks.bench_zero import init_process

    init_process(rank, world, port)
    runners, errors = {}, {}
    for kind in ("megazero", "deepspeed"):
        try:
            runners[kind] = _Runner(args, kind, device)
        except Exception as e:  # a peer that cannot run its NVMe offload here: said, and left out
            errors[kind] = f"{type(e).__name__}: {e}"
    times = {k: [] for k in runners}
    losses = {k: [r.step() for _ in range(1)] for k, r in runners.items()}  # warm-up: optimizer states
    for _ in range(args.trials):
        for kind, runner in runners.items():
            dist.barrier()
            start = time.perf_counter()
            losses[kind] += [runner.step() for _ in range(args.steps)]
            times[kind].append((time.perf_counter() - start) / args.steps)
    if rank == 0:
        queue.put({"times": times, "losses": losses, "errors": errors})
    dist.destroy_process_group()


def _ds_memory(rank: int, world: int, port: int, args, kind: str, device: str, queue) -> None:
    from benchmarks.bench_zero import init_process

    init_process(rank, world, port)
    runner = _Runner(args, kind, device)
    for _ in range(2):
        runner.step()
    queue.put((rank, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
    dist.destroy_process_group()


def _deepspeed(args) -> None:
    """megazero vs DeepSpeed, ZeRO-3 + optimizer and parameter offload, DP=2 (see the docstring)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from benchmarks.bench_zero import deepspeed_version, spawn_workers

    version = deepspeed_version()
    if version is None:
        print("DeepSpeed column skipped: deepspeed does not import (pip install -e .[bench], or make bench)")
        return
    device, why = _ds_device(args) if args.ds_device == "auto" else (args.ds_device, None)
    if why:
        print(f"DeepSpeed {version}: its NVMe offload cannot run here ({why}); both offload to device cpu instead")
    elif device == "cpu":
        print(f"DeepSpeed {version}: both offload to device cpu (--ds-device cpu)")
    (result,) = spawn_workers(_ds_throughput, (args, device), DS_WORLD, 1)
    tokens = args.batch * args.seq  # per step, both ranks
    rows = {}
    for kind, times in result["times"].items():
        peaks = spawn_workers(_ds_memory, (args, kind, device), DS_WORLD, DS_WORLD)
        rows[kind] = {"tokens_per_s": statistics.median(tokens / t for t in times),
                      "s_per_step": statistics.median(times), "peak_rss_MiB": max(p for _, p in peaks) / 2**20,
                      "losses": result["losses"][kind]}
    if "megazero" in rows and "deepspeed" in rows:
        ratios = [d / m for m, d in zip(result["times"]["megazero"], result["times"]["deepspeed"])]
        rows["megazero"]["speed_vs_deepspeed"] = statistics.median(ratios)
    load = os.getloadavg()
    print(f"GPT {args.layers} layers x {args.hidden}, bf16, DP={DS_WORLD}, ZeRO-3, offload_optimizer and offload_param "
          f"{device} ({args.nvme_path if device == 'nvme' else 'host memory'}), DeepSpeed {version}, "
          f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    print(f"{'engine':<11}{'tokens/s':>10}{'s/step':>9}{'peak RSS MiB/rank':>19}{'speed vs DS':>13}")
    for kind, r in rows.items():
        vs = f"{r['speed_vs_deepspeed']:.2f}" if "speed_vs_deepspeed" in r else "-"
        print(f"{kind:<11}{r['tokens_per_s']:>10.1f}{r['s_per_step']:>9.2f}{r['peak_rss_MiB']:>19.0f}{vs:>13}")
    for kind, error in result["errors"].items():
        print(f"{kind} could not run: {error}")
    out = args.out.replace("offload.json", "offload_deepspeed.json")
    write_result(os.path.basename(out)[:-5], {"deepspeed": version, "device": device, "why_not_nvme": why,
                                              "rows": rows, "errors": result["errors"]}, args=args, out=out)


if __name__ == "__main__":
    main()
