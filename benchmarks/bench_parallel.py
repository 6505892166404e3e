"""Model-parallel layouts side by side on the recipe's GPT: DP=2, TP=2 (with and without sequence
parallelism), PP=2 with M = 4 and M = 8 micro-batches; and the recipe's Llama (llama_cpu.json:
GQA, RoPE, SwiGLU, untied; GPT's parameter count within 0.2%) at DP=2 and TP=2, next to the GPT.

Two gloo ranks (one thread each); every layout trains the same model (vocabulary 8192 so no
layout pads it differently) from the same seed on the same global batches (8 x 256 tokens,
AdamW, clipping, fp32). All engines live in the same two processes and take turns (alternating
trials), so machine noise hits all alike. Reported per layout: tokens/s and its ratio to DP=2,
parameter bytes per rank, and for the pipelines the measured bubble (the fraction of the
schedule a stage spends outside its forward and backward compute, mean over stages) next to
1F1B's (p - 1) / (m + p - 1). Writes benchmarks/results/parallel.json.

--bubbles WORLD (2 or 4): the pipeline bubble table instead, on WORLD gloo ranks (one thread each):
PP=WORLD with m = 4, 8, 16 micro-batches of one sample, plain 1F1B (v=1) and interleaved (v=2),
next to DP=WORLD on the same global batch; the recipe's GPT at 16 layers and hidden 192
(--num-layers, --hidden-size: a layer is then fine enough a grain for the measured split to balance
the output layer and loss). Measured bubble: the time each rank spends blocked in p2p exchanges over
its schedule time (mean over ranks, and each rank's); theory: (p - 1) / (v m) of the ideal time,
which as a fraction of the step is (p - 1) / (v m + p - 1). --partition-methods parameters measured:
each PP row at both stage splits (models.parallelize.stage_layers; the rows of a split other than
parameters end in _<method>; each row records every rank's layers; at v = 2 the compute and
measured splits are chosen for the row's m, as a recipe's are for its gradient accumulation steps).
--transports shm backend: each PP row through shared memory and through gloo, side by side in one
run (pipeline.p2p_transport; the rows of the second end in _backend). --schedules (default 1f1b
zb-h1 zbv): each v=1 PP row also under the zero-bubble H1 schedule (rows ending in _zbh1) and, where
m >= 2p, the zero-bubble V schedule (two chunks per stage in a V: rows ending in _zbv), with the
bubble from the row's measured F, B and W times per micro-batch beside it (1F1B's and ZB-H1's
formulas; ZBV's schedule simulated with those costs, megazero.pipeline.actions.simulate). Every row
also gives each rank's peak activation memory over one more step (megazero.profiling.memory.
PeakActivationMeter: what the rank keeps for backward at once, pending W inputs included).
Writes benchmarks/results/parallel_bubbles_pp{WORLD}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import megazero
import models.parallelize
from benchmarks.bench_zero import param_groups, recipe_config, spawn_workers
from benchmarks.record import write_result
from megazero import parallel_state
from megazero.data import GPTDataset, IndexedDataset
from megazero.pipeline import bubble_fraction, interleaved_bubble_fraction
from megazero.pipeline.actions import simulate, zero_bubble_v
from megazero.profiling.memory import PeakActivationMeter
from models.gpt import GPTConfig
from models.llama import LlamaConfig
from models.parallelize import parallelize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GLOBAL_BATCH = 8
# name: (TP, PP, sequence parallel, micro-batch size)
LAYOUTS = {"dp2": (1, 1, False, 4), "tp2": (2, 1, False, 8), "tp2_sp": (2, 1, True, 8),
           "pp2_m4": (1, 2, False, 2), "pp2_m8": (1, 2, False, 1),
           "llama_dp2": (1, 1, False, 4), "llama_tp2": (2, 1, False, 8)}
LLAMA_PEERS = {"llama_dp2": "dp2", "llama_tp2": "tp2"}  # the Llama layouts and the GPT runs they compare with
# 16 layers at hidden 192: the measured split can balance the head (~2 layers of time here) to within
# a few % of a stage, which 8 layers (a stage is 4) cannot; PP=4 x v=2 still has 2 layers per chunk
BUBBLE_LAYERS = 16
BUBBLE_HIDDEN = 192
BUBBLE_MICRO_BATCHES = (4, 8, 16)
COMPUTE = ("forward", "backward", "backward_weight")  # the engine's timers of F, B and a split schedule's W


def bubble_layouts(world: int, methods: tuple[str, ...] = ("parameters",), layers: int = BUBBLE_LAYERS,
                   transports: tuple[str, ...] = ("auto",), schedules: tuple[str, ...] = ("1f1b",)) -> dict[str, dict]:
    """--bubbles: name -> {tp, pp, sp, micro, batch, chunks, layers, split, transport, schedule}: DP=world
    and PP=world (v = 1, 2, at each stage split of `methods` and each p2p transport of `transports`:
    pipeline.p2p_transport; v = 1 also at each pipeline.schedule of `schedules` after 1f1b, rows ending
    in _<schedule>) at each m, the same global batch of m samples."""
    layouts = {}
    for m in BUBBLE_MICRO_BATCHES:
        common = {"tp": 1, "sp": False, "batch": m, "layers": layers, "split": "parameters", "transport": "auto",
                  "schedule": "1f1b"}
        layouts[f"dp{world}_b{m}"] = {**common, "pp": 1, "micro": m // world, "chunks": 1}
        for v in (1, 2):
            for method in methods:
                for transport in transports:
                    for schedule in schedules if v == 1 else ("1f1b",):
                        if schedule == "zbv" and m < 2 * world:
                            continue  # zbv needs 2p micro-batches
                        suffix = "" if method == "parameters" else f"_{method}"
                        suffix += "" if transport == transports[0] else f"_{transport}"
                        suffix += "" if schedule == "1f1b" else f"_{schedule.replace('-', '')}"
                        chunks = 2 if schedule == "zbv" else v  # zbv's two chunks in a V, on the v=1 row
                        layouts[f"pp{world}_m{m}_v{v}{suffix}"] = {**common, "pp": world, "micro": 1, "chunks": chunks,
                                                                   "split": method, "transport": transport,
                                                                   "schedule": schedule}
    # the case with a shape header on every p2p message, as before the shape cache
    if "parameters" in methods:
        layouts[f"pp{world}_m8_v1_headers"] = {**layouts[f"pp{world}_m8_v1"], "headers": True}
    return layouts


def layout_spec(name: str, args) -> dict:
    """A layout's {tp, pp, sp, micro, batch, chunks, layers, split} (layers None: the recipe's)."""
    if args.bubbles:
        return bubble_layouts(args.bubbles, tuple(args.partition_methods), args.num_layers,
                              tuple(args.transports), tuple(args.schedules))[name]
    tp, pp, sp, micro = LAYOUTS[name]
    return {"tp": tp, "pp": pp, "sp": sp, "micro": micro, "batch": GLOBAL_BATCH, "chunks": 1, "layers": None,
            "split": "parameters", "transport": "auto", "schedule": "1f1b"}


def model_config(name: str, tp: int, sp: bool, layers: int | None = None, hidden: int | None = None,
                 seq: int | None = None):
    """The recipe's GPT, or for the llama_* layouts the recipe's Llama, at this layout."""
    config_class, path = (LlamaConfig, "llama_cpu.json") if name in LLAMA_PEERS else (GPTConfig, "gpt2_cpu.json")
    return config_class.from_json(os.path.join(REPO, "configs", path), vocab_size=8192, tensor_model_parallel_size=tp,
                                  sequence_parallel=sp or None, num_layers=layers, hidden_size=hidden,
                                  seq_length=seq)


class LayoutRun:
    """One layout's engine and an endless iterator over its loader."""

    def __init__(self, name: str, args):
        spec = layout_spec(name, args)
        tp, pp, micro, chunks = spec["tp"], spec["pp"], spec["micro"], spec["chunks"]
        self.pp = pp
        self.micro_batches = spec["batch"] // micro // (dist.get_world_size() // (tp * pp))
        grid = parallel_state.initialize_model_parallel(tp, pp)
        config = model_config(name, tp, spec["sp"], spec["layers"], args.hidden_size, args.seq_length)
        megazero.set_seed(0)
        weighed = []  # the stage weights the split was chosen by (measured ones vary from build to build)
        stage_weights = models.parallelize.stage_weights
        models.parallelize.stage_weights = lambda *a, **k: weighed.append(stage_weights(*a, **k)) or weighed[-1]
        try:
            interleaved = chunks > 1 and spec["schedule"] != "zbv"
            model = parallelize(config, grid, config.num_layers // (pp * chunks) if interleaved else None,
                                spec["split"], num_microbatches=self.micro_batches,  # the interleaved split: for this m
                                pipeline_schedule=spec["schedule"])
        finally:
            models.parallelize.stage_weights = stage_weights
        self.weights = weighed[0] if weighed else None
        with open(os.path.join(REPO, "configs", "ds_gpt2_cpu.json")) as f:  # recipe_config() leaves it out
            optimizer = json.load(f)["optimizer"]
        engine_config = {**recipe_config(), "optimizer": optimizer, "train_batch_size": spec["batch"],
                         "train_micro_batch_size_per_gpu": micro, "wall_clock_breakdown": True,
                         "pipeline": {"p2p_transport": spec["transport"], "schedule": spec["schedule"]}}
        dataset = GPTDataset(IndexedDataset(args.data_path + "_train_text_document"), config.seq_length, seed=1)
        self.engine, _, loader, _ = megazero.initialize(model=model, model_parameters=param_groups(model),
                                                        training_data=dataset, config=engine_config,
                                                        mpu=parallel_state)
        if spec.get("headers"):
            self.engine.pipeline.shapes = None  # no shape cache: every message carries its header
        self.data = iter(loader)
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.layers = [[c.layers.start, c.layers.stop] for c in getattr(model, "chunks", [model])]
        self.busy = self.schedule = self.p2p = 0.0
        self.compute = dict.fromkeys(COMPUTE, 0.0)  # seconds of F, B (W included where not split) and W

    def step(self) -> float:
        timers = self.engine.timers
        before = {n: timers(n).elapsed for n in (*COMPUTE, "step", "pipe_send_recv")}
        start = time.perf_counter()
        loss = self.engine.train_batch(self.data).item()
        wall = time.perf_counter() - start
        after = {n: timers(n).elapsed for n in before}
        for n in COMPUTE:
            self.compute[n] += after[n] - before[n]
        self.busy += sum(after[n] - before[n] for n in COMPUTE)
        self.schedule += wall - (after["step"] - before["step"])
        self.p2p += after["pipe_send_recv"] - before["pipe_send_recv"]
        return loss


def worker(rank: int, world: int, port: int, args, queue) -> None:
    from benchmarks.bench_zero import init_process

    init_process(rank, world, port)
    runs = {name: LayoutRun(name, args) for name in args.layouts}
    losses = {name: [run.step() for _ in range(args.warmup)] for name, run in runs.items()}
    for run in runs.values():
        run.busy = run.schedule = run.p2p = 0.0
        run.compute = dict.fromkeys(COMPUTE, 0.0)
    times = {name: [] for name in runs}
    for _ in range(args.trials):
        for name, run in runs.items():
            dist.barrier()
            start = time.perf_counter()
            losses[name] += [run.step() for _ in range(args.steps)]
            times[name].append(time.perf_counter() - start)
    peaks = {}  # one more step of each: the most activation bytes a rank keeps for backward at once
    for name, run in runs.items():
        with PeakActivationMeter(exclude=run.engine.module.parameters()) as meter:
            losses[name].append(run.step())
        peaks[name] = meter.peak
    bubbles = {name: run.schedule and 1 - run.busy / run.schedule for name, run in runs.items()}
    blocked = {name: run.schedule and run.p2p / run.schedule for name, run in runs.items()}
    busy = {name: run.busy / (args.trials * args.steps) for name, run in runs.items()}
    compute = {name: {n: t / (args.trials * args.steps) for n, t in run.compute.items()} for name, run in runs.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, {"bubble": bubbles, "blocked": blocked, "busy": busy, "losses": losses,
                                      "compute": compute, "activation_peak": peaks,
                                      "param_bytes": {n: r.param_bytes for n, r in runs.items()},
                                      "layers": {n: r.layers for n, r in runs.items()},
                                      "weights": {n: r.weights for n, r in runs.items()}})
    if rank == 0:
        queue.put({"times": times, "ranks": gathered,
                   "micro_batches": {n: r.micro_batches for n, r in runs.items()}})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", default=os.path.join(REPO, "data", "gpt2", "shakespeare"))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS),
                        help=f"default: all of {list(LAYOUTS)}, or with --bubbles all of its own")
    parser.add_argument("--steps", type=int, default=2, help="steps per trial")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/parallel[_bubbles_pp{WORLD}].json")
    parser.add_argument("--bubbles", type=int, choices=[2, 4], default=None,
                        help="the pipeline bubble table on this many ranks instead (see the module docstring)")
    parser.add_argument("--num-layers", type=int, default=BUBBLE_LAYERS,
                        help=f"--bubbles: the GPT's layers (default {BUBBLE_LAYERS})")
    parser.add_argument("--hidden-size", type=int, default=None,
                        help=f"override the recipe GPT's (default 384; {BUBBLE_HIDDEN} with --bubbles)")
    parser.add_argument("--seq-length", type=int, default=None, help="override the recipe GPT's (default 256)")
    parser.add_argument("--partition-methods", nargs="+", choices=["parameters", "compute", "measured"],
                        default=["parameters"],
                        help="--bubbles: the stage splits to measure each PP row at (default: parameters)")
    parser.add_argument("--transports", nargs="+", choices=["auto", "backend", "shm"], default=["auto"],
                        help="--bubbles: the pipeline.p2p_transport of each PP row (rows of all but the first end "
                             "in _<transport>; default: auto, which is shm here)")
    parser.add_argument("--schedules", nargs="+", choices=["1f1b", "zb-h1", "zbv"], default=["1f1b", "zb-h1", "zbv"],
                        help="--bubbles: the pipeline.schedule of each v=1 PP row (rows of all but 1f1b end in "
                             "_<schedule>; default: all three)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.bubbles:
        return bubbles_main(args)
    args.out = args.out or os.path.join(REPO, "benchmarks", "results", "parallel.json")
    unknown = set(args.layouts) - set(LAYOUTS)
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)}: choose from {list(LAYOUTS)}")
    result = spawn_workers(worker, (args,))[0]
    seq = GPTConfig.from_json(os.path.join(REPO, "configs", "gpt2_cpu.json")).seq_length
    tokens = args.steps * GLOBAL_BATCH * seq
    base = args.layouts[0]
    rows = {}
    for name in args.layouts:
        tp, pp, sp, micro = LAYOUTS[name]
        per_trial = [tokens / t for t in result["times"][name]]
        ranks = result["ranks"]
        rows[name] = {
            "tp": tp, "pp": pp, "sequence_parallel": sp, "micro_batch": micro,
            "micro_batches": result["micro_batches"][name], "tokens_per_s": statistics.median(per_trial),
            "trials": per_trial,
            "ratio_to_" + base: statistics.median(b / t for b, t in zip(result["times"][base], result["times"][name])),
            "param_mb_per_rank": [r["param_bytes"][name] / 2 ** 20 for r in ranks],
            "first_loss": statistics.mean(r["losses"][name][0] for r in ranks),  # same model and data: equal
            "model": "llama" if name in LLAMA_PEERS else "gpt",
        }
        peer = LLAMA_PEERS.get(name)
        if peer in args.layouts:  # per-trial ratios: both ran in the same trial, back to back
            rows[name]["ratio_to_gpt_" + peer] = statistics.median(
                g / t for g, t in zip(result["times"][peer], result["times"][name]))
        if pp > 1:
            rows[name]["bubble_measured"] = statistics.mean(r["bubble"][name] for r in ranks)
            rows[name]["bubble_1f1b"] = bubble_fraction(pp, result["micro_batches"][name])
    print(f"recipe GPT (gpt2_cpu.json, vocab 8192), 2 gloo ranks x 1 thread, fp32, {GLOBAL_BATCH} x {seq} tokens/step,"
          f" {args.trials} alternating trials of {args.steps} steps")
    print(f"{'layout':<22}{'tokens/s':>10}{'vs ' + base:>9}{'param MB/rank':>15}{'bubble':>9}{'(p-1)/(m+p-1)':>15}"
          f"{'first loss':>12}")
    for row in rows.values():
        label = ("Llama " if row["model"] == "llama" else "") + f"TP{row['tp']} PP{row['pp']}" + \
            (" SP" if row["sequence_parallel"] else "") + f" m={row['micro_batches']}"
        bubble = f"{row['bubble_measured']:.3f}" if "bubble_measured" in row else "-"
        formula = f"{row['bubble_1f1b']:.3f}" if "bubble_1f1b" in row else "-"
        print(f"{label:<22}{row['tokens_per_s']:>10,.0f}{row['ratio_to_' + base]:>9.3f}"
              f"{max(row['param_mb_per_rank']):>15.1f}{bubble:>9}{formula:>15}{row['first_loss']:>12.5f}")
    print("m: micro-batches per step per data-parallel rank; bubble: 1 - (forward + backward time) / schedule time")
    for name, row in rows.items():
        peer = LLAMA_PEERS.get(name)
        if "ratio_to_gpt_" + str(peer) in row:
            print(f"Llama / GPT tokens/s at {peer.upper()}: {row['ratio_to_gpt_' + peer]:.3f} (median of per-trial "
                  f"ratios; first losses {row['first_loss']:.4f} vs {rows[peer]['first_loss']:.4f})")
    write_result("parallel", {"rows": rows}, args=args, out=args.out)


def measured_cost_bubble(schedule: str, p: int, m: int, f: float, b: float, w: float) -> float:
    """The bubble as a fraction of the step for F, B and W seconds per micro-batch (a whole stage's):
    1F1B (p - 1)(F + B + W), ZB-H1 (p - 1)(F + B - W) (the DualPipe README's formulas), ZBV its
    schedule simulated with half of each per chunk."""
    if schedule == "zbv":
        timeline = simulate(zero_bubble_v(p, m), f / 2, b / 2, w / 2)
        return 1 - m * (f + b + w) / timeline.makespan
    bubble = (p - 1) * ((f + b + w) if schedule == "1f1b" else (f + b - w))
    return bubble / (m * (f + b + w) + bubble)


def bubbles_main(args) -> None:
    """--bubbles: DP and PP (v = 1, 2) at m = 4, 8, 16 on args.bubbles ranks, alternating trials."""
    world = args.bubbles
    if args.hidden_size is None:
        args.hidden_size = BUBBLE_HIDDEN
    layouts = bubble_layouts(world, tuple(args.partition_methods), args.num_layers, tuple(args.transports),
                             tuple(args.schedules))
    if args.layouts == list(LAYOUTS):
        args.layouts = list(layouts)
    result = spawn_workers(worker, (args,), world=world)[0]
    config = model_config("", 1, False, args.num_layers, args.hidden_size, args.seq_length)
    seq = config.seq_length
    rows = {}
    for name in args.layouts:
        spec, ranks = layouts[name], result["ranks"]
        tokens = args.steps * spec["batch"] * seq
        base = f"dp{world}_b{spec['batch']}"
        row = {**spec, "micro_batches": result["micro_batches"][name],
               "tokens_per_s": statistics.median(tokens / t for t in result["times"][name]),
               "ratio_to_dp": statistics.median(b / t for b, t in zip(result["times"][base], result["times"][name])),
               "busy_s_per_step": [r["busy"][name] for r in ranks],
               "activation_peak_mb_per_rank": [r["activation_peak"][name] / 2 ** 20 for r in ranks]}
        if spec["pp"] > 1:
            p, v, m = spec["pp"], spec["chunks"], row["micro_batches"]
            row["blocked_in_p2p"] = [r["blocked"][name] for r in ranks]
            row["layers_per_rank"] = [r["layers"][name] for r in ranks]
            row["stage_weights"] = ranks[0]["weights"][name]  # (per layer, first stage's extra, last's)
            row["bubble_measured"] = statistics.mean(row["blocked_in_p2p"])
            row["not_computing"] = statistics.mean(r["bubble"][name] for r in ranks)
            row["theory_over_ideal"] = interleaved_bubble_fraction(p, m, v)
            row["theory_fraction_of_step"] = (p - 1) / (v * m + p - 1)
            if v == 1 or spec["schedule"] == "zbv":  # the bubble with this row's own F, B and W per micro-batch
                f, b, w = (statistics.mean(r["compute"][name][n] for r in ranks) / m for n in COMPUTE)
                row["f_b_w_seconds"] = [f, b, w]
                row["theory_with_measured_costs"] = measured_cost_bubble(spec["schedule"], p, m, f, b, w)
        rows[name] = row
    print(f"recipe GPT at {args.num_layers} layers, hidden {config.hidden_size} (vocab 8192), {world} gloo ranks x 1 "
          f"thread, fp32, micro-batches of 1 x {seq} tokens, {args.trials} alternating trials of {args.steps} steps")
    print(f"{'layout':<24}{'tokens/s':>10}{'vs DP':>8}{'blocked in p2p':>16}{'not computing':>15}"
          f"{'(p-1)/(vm)':>12}{'(p-1)/(vm+p-1)':>16}{'F,B,W formula':>15}{'act. MB':>9}  busy s/step, blocked per "
          f"rank")
    for row in rows.values():
        if row["pp"] == 1:
            label, cells = f"DP={world} b={row['batch']}", f"{'-':>16}{'-':>15}{'-':>12}{'-':>16}{'-':>15}"
        else:
            label = f"PP={row['pp']} m={row['micro_batches']} v={row['chunks']}"
            label += " hdr" if row.get("headers") else ""
            label += "" if row["split"] == "parameters" else f" {row['split'][:4]}"
            label += "" if row["transport"] == args.transports[0] else f" {row['transport'][:4]}"
            label += "" if row["schedule"] == "1f1b" else f" {row['schedule']}"
            formula = row.get("theory_with_measured_costs")
            cells = (f"{row['bubble_measured']:>16.3f}{row['not_computing']:>15.3f}{row['theory_over_ideal']:>12.3f}"
                     f"{row['theory_fraction_of_step']:>16.3f}" + (f"{formula:>15.3f}" if formula is not None
                                                                   else f"{'-':>15}"))
        busy = " ".join(f"{b:.2f}" for b in row["busy_s_per_step"])
        busy += "  " + " ".join(f"{b:.3f}" for b in row.get("blocked_in_p2p", []))
        peak = f"{max(row['activation_peak_mb_per_rank']):>9.1f}"
        print(f"{label:<24}{row['tokens_per_s']:>10,.0f}{row['ratio_to_dp']:>8.3f}{cells}{peak}  {busy}")
    print("blocked in p2p: time in the pipeline's exchanges / schedule time (mean over ranks); not computing: "
          "1 - (forward + backward) / schedule time; F,B,W formula: the bubble as a fraction of the step from the "
          "row's measured F, B and W per micro-batch, 1F1B (p-1)(F+B+W), ZB-H1 (p-1)(F+B-W), ZBV its schedule "
          "simulated; act. MB: the most activation memory a rank keeps for backward at once (largest rank; a split "
          "backward's pending W inputs included)")
    out = args.out or os.path.join(REPO, "benchmarks", "results", f"parallel_bubbles_pp{world}.json")
    write_result(f"parallel_bubbles_pp{world}", {"world": world, "rows": rows}, args=args, out=out)


if __name__ == "__main__":
    main()
