"""Generate docs/benchmarks.md from the results the benchmarks wrote (benchmarks/results/*.json).

    python -m benchmarks.report                 # writes docs/benchmarks.md
    python -m benchmarks.report --check         # exit 1 if docs/benchmarks.md is not what it would write
    python -m benchmarks.report --results DIR --out PATH

The page is a function of the JSON files only (no clock, no machine probe), so the committed page
can be checked against the committed results (tests/unit/test_benchmark_report.py). One section
per benchmark: what it measures, the command that produced the file, the machine, torch and date
recorded in it, and its table; a benchmark without a result file is listed as not run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
PAGE = os.path.join(REPO, "docs", "benchmarks.md")


# ---- formatting ----------------------------------------------------------------------------------
def num(value, digits: int | None = None) -> str:
    """A number for a table cell: thousands separators, about 3 significant digits (or `digits`
    decimals); lists as their values joined (per rank), None and missing as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return " / ".join(num(v, digits) for v in value) if value else "-"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:
            return "-"
        if digits is not None:
            return f"{value:,.{digits}f}"
        magnitude = abs(value)
        if magnitude >= 100:
            return f"{value:,.0f}"
        if magnitude >= 10:
            return f"{value:.1f}"
        if magnitude >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}" if magnitude >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value).replace("|", "/").replace("\n", " ")


def ratio(value) -> str:
    return num(value, 3) if isinstance(value, float) else num(value)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


@dataclass
class Col:
    """A column: its header, how to get the value from a row, how to format it."""
    header: str
    get: str | Callable
    fmt: Callable = num

    def cell(self, row: dict) -> str:
        value = self.get(row) if callable(self.get) else row.get(self.get)
        return self.fmt(value)


def rows_table(rows, cols: list[Col], label: str = "", labels: dict | None = None) -> str:
    """A table of `rows` (a dict of name -> row, or a list of rows) with `cols`; a dict's names
    make the first column (`label` its header, `labels` their display names)."""
    if isinstance(rows, dict):
        body = [[(labels or {}).get(name, name)] + [c.cell(row) for c in cols] for name, row in rows.items()]
        return table([label] + [c.header for c in cols], body)
    return table([c.header for c in cols], [[c.cell(row) for c in cols] for row in rows])


def generic_table(rows) -> str:
    """Every scalar field of every row (for results without a layout of their own)."""
    items = list(rows.items()) if isinstance(rows, dict) else [(None, r) for r in rows]
    keys = []
    for _, row in items:
        for key, value in (row.items() if isinstance(row, dict) else []):
            if key not in keys and not isinstance(value, dict) and not (isinstance(value, list) and len(value) > 4):
                keys.append(key)
    cols = [Col(k.replace("_", " "), k) for k in keys]
    if isinstance(rows, dict):
        return rows_table(rows, cols, "")
    return rows_table([r for _, r in items], cols)


def max_of(key: str) -> Callable:
    return lambda row: max(row[key]) if row.get(key) else None


# ---- one renderer per result file ----------------------------------------------------------------
ZERO_LABELS = {"ddp": "torch DDP", "fsdp2": "torch FSDP2 (fully_shard)",
               **{f"zero{s}": f"megazero ZeRO-{s}" for s in range(4)},
               **{f"ds{s}": f"DeepSpeed ZeRO-{s}" for s in range(4)}}


def render_zero(r: dict) -> str:
    cols = [Col("tokens/s", "tokens_per_s"), Col("vs DDP", "ratio_to_ddp", ratio),
            Col("vs DeepSpeed, same stage", "ratio_to_deepspeed", ratio),
            Col("peak RSS MB per rank (max)", max_of("peak_rss_mb")),
            Col("model states MB per rank (max)", max_of("state_mb")),
            Col("loss diff vs first", "max_abs_loss_diff", lambda v: f"{v:.1e}")]
    text = rows_table(r["rows"], cols, "configuration", ZERO_LABELS)
    return (f"GPT {r['params'] / 1e6:.1f} M parameters, {r['precision']}, dropout {r['dropout']}; DeepSpeed "
            f"{r.get('deepspeed') or 'not installed'}; megazero collectives: {r['collectives']}.\n\n{text}\n\n"
            f"vs DDP, vs DeepSpeed: median over trials of the ratio of step times (> 1: faster). Model states: "
            f"parameters + gradients + optimizer states held per rank after a step (DeepSpeed's are not "
            f"reported). The script's verdict: {r['losses']}.")


def render_collectives(r: dict) -> str:
    return (f"{r['mib']:g} MiB fp32 buffer.\n\n"
            + rows_table(r["rows"], [Col("ms (median)", "ms"), Col("speed-up over the native call", "vs native",
                                                                   lambda v: f"{v:.2f}x" if v else "-")],
                         "operation"))


def _parallel_label(name: str, row: dict) -> str:
    if row["pp"] > 1:
        layout = f"PP={row['pp']}, m={row['micro_batches']}"
    else:
        layout = f"TP={row['tp']}" if row["tp"] > 1 else "DP=2"
    label = ("Llama " if row.get("model") == "llama" else "") + layout
    return label + (" + sequence parallel" if row.get("sequence_parallel") else "") + f" ({name})"


def render_parallel(r: dict) -> str:
    rows = r["rows"]
    base = next(iter(rows))
    cols = [Col("tokens/s", "tokens_per_s"), Col(f"vs {base}", f"ratio_to_{base}", ratio),
            Col("parameter MB per rank", max_of("param_mb_per_rank")),
            Col("measured bubble", "bubble_measured", ratio), Col("1F1B (p-1)/(m+p-1)", "bubble_1f1b", ratio),
            Col("Llama vs GPT, same layout", lambda row: next((v for k, v in row.items()
                                                             if k.startswith("ratio_to_gpt_")), None), ratio),
            Col("first loss", "first_loss", lambda v: num(v, 4))]
    return rows_table(rows, cols, "layout", {n: _parallel_label(n, row) for n, row in rows.items()})


def render_bubbles(r: dict) -> str:
    def label(name, row):
        if row["pp"] == 1:
            return f"DP={r['world']}, batch {row.get('batch')}"
        schedule = row.get("schedule", "1f1b")
        return (f"PP={row['pp']}, m={row['micro_batches']}, v={row.get('chunks')} "
                f"({row.get('split')}, {row.get('transport')}{'' if schedule == '1f1b' else ', ' + schedule}"
                f"{', a shape header on every message' if row.get('headers') else ''})")
    cols = [Col("tokens/s", "tokens_per_s"), Col("vs DP", "ratio_to_dp", ratio),
            Col("blocked in p2p (mean)", "bubble_measured", ratio),
            Col("(p-1)/(vm+p-1)", "theory_fraction_of_step", ratio),
            Col("bubble from measured F, B, W (fraction)", "theory_with_measured_costs", ratio),
            Col("peak activations MB per rank", "activation_peak_mb_per_rank", lambda v: num(v, 1)),
            Col("busy s/step per rank", "busy_s_per_step", lambda v: num(v, 2))]
    return rows_table(r["rows"], cols, "layout", {n: label(n, row) for n, row in r["rows"].items()})


def render_activations(r: dict) -> str:
    parts = []
    for key, rows in r["results"].items():
        cols = [Col("activations MB", "activation_mb"), Col("vs none", "memory_vs_none", ratio),
                Col("forward + backward s", "step_s", lambda v: num(v, 3)), Col("vs none", "time_vs_none", ratio),
                Col("gradients equal none's", "grads_equal_none")]
        parts.append(f"Dropout {key.split('_', 1)[1]}, micro-batch {r['micro_batch']}:\n\n"
                     + rows_table(rows, cols, "recompute"))
    return "\n\n".join(parts)


def render_cpu_adam(r: dict) -> str:
    parts = [f"{r['params'] / 1e6:,.0f} M fp32 parameters, ISA {r['isa']}."]
    for threads, rows in r["results"].items():
        cols = [Col("ms", "ms"), Col("GB/s", "GB/s"), Col("of axpy bandwidth", "of_bandwidth", lambda v: num(v, 2)),
                Col("megazero's speed-up", lambda row: ", ".join(f"{v:.2f}x {k}" for k, v in row.items()
                                                                 if k.startswith("vs ")) or None)]
        parts.append(f"{threads}:\n\n" + rows_table(rows, cols, "row"))
    return "\n\n".join(parts)


def render_watchdog(r: dict) -> str:
    cols = [Col("tokens/s off", "tokens_per_s_off"), Col("tokens/s on", "tokens_per_s_on"),
            Col("on / off", "ratio_on_to_off", ratio), Col("marked ops per step", "marked_ops_per_step"),
            Col("marks' share of the step (bound)", "mark_bound_fraction", lambda v: f"{100 * v:.4f}%")]
    return (f"Watchdog timeout {r['timeout_s']:g} s; one mark (begin + end) {r['mark_s'] * 1e6:.2f} us; "
            f"{r['trials']} paired trials of {r['steps']} steps.\n\n" + rows_table(r["stages"], cols, "ZeRO stage"))


def render_moe(r: dict) -> str:
    cols = [Col("parameters", "parameters"), Col("active", "active_parameters"), Col("tokens/s", "tokens_per_s"),
            Col("vs dense", "ratio_to_dense", ratio), Col("steps in equal time", "train_steps"),
            Col("valid loss", "valid_loss", lambda v: num(v, 4))]
    text = rows_table(r["rows"], cols, "model")
    shares = (r["rows"].get("moe_ep2") or {}).get("all_to_all_share") or {}
    notes = "; ".join(f"{kind} {num(v, 3)}" for kind, v in shares.items())
    return (f"{'--quick shape. ' if r.get('quick') else ''}Equal training time: {r['train_seconds']:g} s of each "
            f"model's own step time.\n\n{text}" + (f"\n\nAll-to-all share of the MoE step, per rank: {notes}."
                                                    if notes else ""))


def render_moe_zero(r: dict) -> str:
    mb = lambda v: num(v / 1e6, 1)  # noqa: E731
    cols = [Col("s / step", "seconds_per_step", lambda v: num(v, 3)), Col("time vs ZeRO-1", "time_vs_zero1", ratio),
            Col("parameters MB", "parameters_bytes", mb), Col("gradients MB", "gradients_bytes", mb),
            Col("optimizer MB", "optimizer_states_bytes", mb), Col("model state MB", "total_bytes", mb),
            Col("memory vs ZeRO-1", "memory_vs_zero1", ratio),
            Col("max loss difference", "max_loss_difference_to_zero1", lambda v: f"{v:.1e}")]
    return (f"{'--quick shape. ' if r.get('quick') else ''}{num(r['dense_parameters'])} dense and "
            f"{num(r['expert_parameters'])} expert parameters; EP={r['ep']} on {r['world']} ranks. Memory: the "
            f"largest rank's model-state bytes in memory after a step ({r.get('note', '')}).\n\n"
            + rows_table(r["rows"], cols, "ZeRO"))


def render_onebit(r: dict) -> str:
    rows = r["rows"]
    cols = [Col("vs", "baseline"), Col("parameters", "parameters"), Col("tokens/s", "tokens_per_s"),
            Col("speedup", "speedup", ratio),
            Col("plain's communication share", "baseline_communication_share", lambda v: num(v, 2)),
            Col("MB sent / step", lambda row: row["sent_bytes_per_step"] / 1e6, lambda v: num(v, 2)),
            Col("plain MB sent / step", lambda row: row["baseline_sent_bytes_per_step"] / 1e6, lambda v: num(v, 1)),
            Col("loss / plain loss", "loss_ratio", ratio),
            Col("warm-up steps equal", lambda row: f"{num(row['warmup_equal'])} ({row.get('warmup_steps', '?')})"),
            Col("speedup >= 1.3, loss <= 1.02x", lambda row: f"{num(row['speedup'] >= 1.3)}, "
                                                             f"{num(row['loss_ratio'] <= 1.02)}")]
    args = (r.get("meta") or {}).get("args") or {}
    return (f"{args.get('steps', '?')} steps each, the first {args.get('freeze_step', '?')} the warm-up; the loss "
            f"is the mean of the last 10 steps'. Targets: after the warm-up, >= 1.3x the plain optimizer's "
            f"tokens/s, the loss within 2%.\n\n" + rows_table(rows, cols, "optimizer"))


def render_offload(r: dict) -> str:
    cols = [Col("in memory s/step", "in_memory_s", lambda v: num(v, 3)),
            Col("NVMe offload s/step", "offloaded_s", lambda v: num(v, 3)),
            Col("offloaded / in memory", "ratio", ratio),
            Col("read GB/s in run", "run_read_GBps", lambda v: num(v, 2)),
            Col("write GB/s in run", "run_write_GBps", lambda v: num(v, 2)),
            Col("MB read / written per step", lambda row: f"{row['read_MB_per_step']:,.0f} / "
                                                          f"{row['write_MB_per_step']:,.0f}", str),
            Col("I/O busy", "io_busy_share", lambda v: f"{100 * v:.0f}%")]
    text = rows_table([{**row, "_label": f"ZeRO-{row['stage']}"} for row in r["rows"]],
                      [Col("stage", "_label", str)] + cols)
    extra = ""
    if r.get("op_alone") and r.get("dd"):
        alone, dd = r["op_alone"], r["dd"]
        extra = (f"\n\nThe aio op alone on the swap files: read {num(alone.get('read'), 2)} GB/s, write "
                 f"{num(alone.get('write'), 2)} GB/s; dd with direct I/O on the same directory: read "
                 f"{num(dd.get('read'), 2)} GB/s, write {num(dd.get('write'), 2)} GB/s.")
    return f"GPT {r['num_params'] / 1e6:.1f} M parameters, bf16, AdamW.\n\n{text}{extra}"


def render_aio(r: dict) -> str:
    two = lambda v: num(v, 2)
    cols = [Col("write GB/s", "write_GBps", two), Col("read GB/s", "read_GBps", two),
            Col("write vs dd", "write_vs_dd", two), Col("read vs dd", "read_vs_dd", two),
            Col("backend", "backend")]
    return (f"One {r['size_bytes'] / 2**20:,.0f} MiB file on {r['filesystem']}, median of {r['trials']} "
            f"alternating trials. {r['page_cache']}\n\n" + rows_table(r["results"], cols, "row"))


def render_faults(r: dict) -> str:
    cols = [Col("fault", "fault"), Col("ranks", "world"), Col("trials", "trials"), Col("survived", "survived"),
            Col("fault to stop (s)", "fault_to_stop_s"), Col("lost", "lost")]
    text = rows_table(r["rows"], cols)
    notes = []
    guard = r.get("guard") or {}
    if "backward_us_new" in guard:
        notes.append(f"a tiny backward with the loss guard: {num(guard['backward_us_new'])} us per call, without "
                     f"{num(guard.get('backward_us_old'))} us (the guard adds {num(guard.get('added_us'))} us)")
    for name, scan in (r.get("scan") or {}).items():
        if isinstance(scan, dict) and "MB_per_s" in scan:
            notes.append(f"token-id scan of {name.replace('_', ' ')} ({num(scan.get('MB'))} MB): "
                         f"{num(scan['MB_per_s'])} MB/s")
    return text + ("\n\n" + "; ".join(notes) + "." if notes else "")


def render_preprocess(r: dict) -> str:
    cols = [Col("input MB", "input_mb"), Col("workers", "workers"), Col("seconds", "seconds"),
            Col("MB/s", "mb_per_s", lambda v: num(v, 2)), Col("peak RSS MB", "peak_rss_mb")]
    return (rows_table(r["runs"], cols) + f"\n\n2 workers over 1: {r['speedup_2_workers']:.2f}x; peak RSS at twice "
            f"the input over once: {r['rss_growth_1x_to_2x']:.2f}x. Blend index of 3 datasets for "
            f"{r['blend_samples']:,} samples: {r['blend_index_seconds']:.2f} s.")


def render_largest(r: dict) -> str:
    cols = [Col("layers", lambda row: (">= " if row.get("capped") else "") + num(row.get("layers")), str),
            Col("parameters (M)", lambda row: row["params"] / 1e6 if row.get("params") else None),
            Col("step s", "step_s"), Col("x DDP", "x_ddp", lambda v: num(v, 2)),
            Col("x ZeRO-3", "x_zero3", lambda v: num(v, 2))]
    return (f"Hidden {r['hidden']}, each rank capped at {r['rank_memory_gib']} GiB of address space.\n\n"
            + rows_table(r["rows"], cols, "configuration"))


def render_gpu_ops(r: dict) -> str:
    return f"Device: {r.get('device')}.\n\n" + generic_table(r["rows"])


def render_generic(r: dict) -> str:
    for key in ("rows", "results", "stages", "runs"):
        if isinstance(r.get(key), (dict, list)) and r[key]:
            return generic_table(r[key])
    return "(no table)"


def render_context(r: dict) -> str:
    """The per-length table, the longest sequence under the memory cap per mode, and the verdicts."""
    parts = [generic_table(r["rows"])]
    if r.get("longest"):
        parts.append("Longest sequence that trains a step with each rank's address space capped (RLIMIT_AS):\n\n"
                     + generic_table([{k: v for k, v in row.items() if k != "tries"} for row in r["longest"]]))
    if r.get("verdicts"):
        parts.append("\n".join(f"- {line}" for line in r["verdicts"]))
    return "\n\n".join(parts)


def render_muon(r: dict) -> str:
    """The step-time table, then the validation-loss curves side by side and the verdict."""
    parts = [generic_table(r["steps"])]
    if r.get("loss"):
        curves = {name: dict(curve["validation"]) for name, curve in r["loss"].items()}
        steps = sorted(set().union(*curves.values()))
        rows = [{"iteration": step, **{f"{name} validation loss": curves[name].get(step) for name in curves}}
                for step in steps]
        parts.append("Validation loss of the GPT recipe at the same tokens:\n\n" + generic_table(rows))
    if r.get("verdict"):
        parts.append(f"- {r['verdict']}")
    return "\n\n".join(parts)


# ---- the page --------------------------------------------------------------------------------------
@dataclass
class Section:
    result: str           # the result file's name (benchmarks/results/<result>.json)
    title: str
    script: str           # the script that writes it
    what: str             # what it measures, one or two sentences
    render: Callable = render_generic
    how: str = ""         # the option that writes this file, where it is not the default run
    variants: list[str] = field(default_factory=list)  # other files of the same script (globs)


SECTIONS = [
    Section("zero", "ZeRO stages against torch DDP, FSDP2 and DeepSpeed (the headline)", "bench_zero.py",
            "The recipe's GPT on 2 gloo ranks (one thread each) with torch DDP, torch FSDP2, megazero ZeRO 0-3 and "
            "DeepSpeed ZeRO 0-3, all in the same two processes taking turns (alternating trials), with the same "
            "weights, batches and optimizer; throughput ratios, peak memory and every step's loss compared.",
            render_zero),
    Section("collectives", "gloo collectives: native against megazero's compositions", "bench_collectives.py",
            "gloo's native reduce-scatter and all-gather against the compositions megazero uses on gloo "
            "(isend/irecv plus an add; one broadcast per rank), 2 ranks, alternating trials.", render_collectives),
    Section("parallel", "Model-parallel layouts", "bench_parallel.py",
            "The recipe's GPT at DP=2, TP=2 (with and without sequence parallelism) and PP=2 (m = 4 and 8), and the "
            "Llama at DP=2 and TP=2, on 2 gloo ranks from the same seed and batches, alternating trials: tokens/s, "
            "parameter bytes per rank and the measured pipeline bubble next to 1F1B's.", render_parallel),
    Section("parallel_bubbles_pp2", "Pipeline bubbles, PP=2", "bench_parallel.py",
            "PP=2 with m = 4, 8, 16 micro-batches, plain 1F1B, zero-bubble ZB-H1 and ZBV, and interleaved, next to "
            "DP=2 on the same global batch: the time blocked in p2p exchanges against (p - 1) / (vm + p - 1) and, for "
            "v=1 and ZBV, against the bubble with the row's measured F, B and W times, as a fraction of the step "
            "(1F1B's idle time (p-1)(F+B+W), ZB-H1's (p-1)(F+B-W), each over the step's m(F+B+W) plus it, so 1F1B's "
            "is (p-1)/(m+p-1) whatever the costs; ZBV its schedule simulated), and each rank's peak activation "
            "memory.", render_bubbles,
            how="--bubbles 2"),
    Section("parallel_bubbles_pp4", "Pipeline bubbles, PP=4", "bench_parallel.py",
            "The same at PP=4 on 4 processes.", render_bubbles, how="--bubbles 4"),
    Section("activations", "Activation recomputation", "bench_activations.py",
            "The activations the recipe's GPT keeps for backward and its forward + backward time without, with "
            "selective (attention core) and with full recomputation, at dropout 0 and 0.1 (one process).",
            render_activations),
    Section("cpu_adam", "The CPU optimizer phase", "bench_cpu_adam.py",
            "megazero's fused C++ Adam and its bf16 optimizer phase against torch's fused AdamW (and DeepSpeedCPUAdam "
            "where DeepSpeed is installed), in GB/s against the machine's measured axpy bandwidth, on 1 and 2 "
            "threads.", render_cpu_adam),
    Section("watchdog", "Hung-rank watchdog overhead", "bench_watchdog.py",
            "The recipe's GPT on 2 gloo ranks with the watchdog off and on in alternating trials, at ZeRO 0 and 2: "
            "the throughput ratio and the bound on what its marks add per step.", render_watchdog),
    Section("moe", "Mixture of experts against the dense model", "bench_moe.py",
            "The recipe's MoE GPT (4 experts, top-2) at EP=2 next to the dense GPT with the same active parameters, "
            "2 gloo ranks: tokens/s, validation loss after equal training time, and the all-to-all's share.",
            render_moe),
    Section("moe_zero", "Mixture of experts under ZeRO 1-3 and offload", "bench_moe_zero.py",
            "The recipe's MoE GPT at EP=2 on 4 gloo ranks (each expert on 2 ranks) at ZeRO 1, 2, 3 and ZeRO-3 with "
            "optimizer and parameter offload to nvme, side by side: model-state bytes per rank, seconds per step "
            "(alternating trials) and the losses, which must agree.", render_moe_zero),
    Section("onebit", "1-bit Adam, 0/1 Adam and 1-bit LAMB against Adam and LAMB", "bench_onebit.py",
            "A GPT whose communication is a large share of Adam's step, on 2 gloo ranks, each compressed-"
            "communication optimizer next to its plain counterpart from the same seed and batches: the loss after "
            "the same steps, then tokens/s and bytes sent per step after the warm-up (alternating trials).",
            render_onebit),
    Section("muon", "Muon against AdamW", "bench_muon.py",
            "The recipe's GPT at DP=1 and DP=2 (2 gloo ranks), AdamW and Muon engines from the same seed taking "
            "turns: the step time, the time Muon adds and the time each rank spends orthogonalising (round-robin "
            "owners against every rank doing every matrix, ZeRO-0 and ZeRO-1); then the GPT recipe's validation "
            "loss with each at the same tokens.", render_muon),
    Section("offload", "Optimizer offload to NVMe", "bench_offload.py",
            "megazero ZeRO-1/2/3 with `zero_optimization.offload_optimizer.device` set to nvme next to the same "
            "stage in memory, one process, alternating trials: the step-time ratio, the swap I/O per step and "
            "the bandwidth it saw against dd with direct I/O.", render_offload,
            variants=["param_offload.json", "param_offload_dp*.json", "param_offload_memory.json",
                      "offload_deepspeed.json", "offload_sweep.json", "offload_*_micro-batch.json",
                      "offload_*_accumulation.json"]),
    Section("aio", "Async I/O bandwidth", "bench_aio.py",
            "Read and write bandwidth of megazero's async I/O op (and its Python fallback) next to dd with direct "
            "I/O and torch.save/torch.load, on one file, alternating trials; the page cache kept out.", render_aio),
    Section("faults_numerics_data", "Fault trials: runaway numerics and bad data files",
            "bench_faults_numerics_data.py",
            "Injected faults (NaN gradients, infinite or NaN losses on 1 and 2 ranks and torchrun jobs; truncated "
            "or corrupted dataset files): how many were survived with a clean stop, how long from the fault to "
            "the stop, and what was lost.", render_faults),
    Section("preprocess", "Streaming preprocessing", "bench_preprocess.py",
            "scripts/preprocess_data.py over generated jsonl corpora with 1 and 2 workers (MB/s, peak RSS at "
            "twice the input) and the time to build a 3-dataset blend index.", render_preprocess),
    Section("context", "Context parallelism on long sequences", "bench_context.py",
            "The CPU Llama at each sequence length, one sample per step: CP=1 (one process, both cores) against "
            "CP=2 (two gloo ranks, one core each) with ring (p2p) and all-to-all (a2a) attention, one after another "
            "in one run: activations kept for backward per rank, peak RSS, tokens/s and the ratios to CP=1 (the "
            "sample's first loss is the same in every mode); then the longest sequence each mode trains under a "
            "per-rank memory cap.", render_context, variants=["context_exposed.json"]),
    Section("largest_model", "The largest model per rank memory", "largest_model.py",
            "The largest GPT that trains a step at DP=2 with each rank's address space capped: torch DDP, megazero "
            "ZeRO-3 under zero.Init, and ZeRO-3 with parameters and optimizer on NVMe.", render_largest),
    Section("gpu_ops", "CUDA kernels against torch (GPU)", "gpu_ops.py",
            "megazero's CUDA kernels (LayerNorm, softmax, bias + GeLU, multi-tensor Adam and LAMB) checked and "
            "timed against torch's own ops at GPT-2 XL shapes; needs a GPU.", render_gpu_ops),
]


def anchor(title: str) -> str:
    """The anchor GitHub gives a heading."""
    return "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def load(results: str) -> dict[str, dict]:
    out = {}
    for path in sorted(glob.glob(os.path.join(results, "*.json"))):
        with open(path) as f:
            out[os.path.basename(path)[:-5]] = json.load(f)
    return out


def provenance(r: dict) -> str:
    meta = r.get("meta") or {}
    m = meta.get("machine") or {}
    mem = f", {m['memory_gib']:g} GiB" if m.get("memory_gib") else ""
    lines = [f"- Command: `{meta.get('command', '?')}`",
             f"- Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores{mem}; torch {meta.get('torch', '?')}, "
             f"Python {meta.get('python', '?')}; {meta.get('date', '?')}"]
    if meta.get("load_average"):
        lines[-1] += f"; load average at the end {' / '.join(f'{x:.2f}' for x in meta['load_average'])}"
    return "\n".join(lines)


def headline(results: dict[str, dict]) -> str:
    """The side-by-side ratios of the headline run: megazero against DDP and DeepSpeed, stage by stage."""
    r = results.get("zero")
    if not r:
        return "The headline (`benchmarks/bench_zero.py`) has not been run on this machine."
    rows = r["rows"]
    body = []
    for stage in range(4):
        row = rows.get(f"zero{stage}")
        if row is None:
            continue
        body.append([f"ZeRO-{stage}", ratio(row.get("ratio_to_ddp")), ratio(row.get("ratio_to_deepspeed")),
                     ratio(rows.get(f"ds{stage}", {}).get("ratio_to_ddp"))])
    fsdp2 = rows.get("fsdp2", {}).get("ratio_to_ddp")
    return ("Throughput ratios from one run in which every configuration takes turns in the same two processes "
            f"(> 1: faster; details in [the headline section](#{anchor(SECTIONS[0].title)})):\n\n"
            + table(["stage", "megazero / DDP", "megazero / DeepSpeed, same stage", "DeepSpeed / DDP"], body)
            + (f"\n\ntorch FSDP2 / DDP in the same run: {ratio(fsdp2)}." if fsdp2 is not None else ""))


def generate(results_dir: str = RESULTS) -> str:
    results = load(results_dir)
    known = set()
    out = ["# Benchmark results", "",
           "<!-- generated by `python -m benchmarks.report` from benchmarks/results/*.json; do not edit -->", "",
           "The latest run of each benchmark, as recorded in its JSON file under `benchmarks/results/`: the "
           "command, the machine and the date are those of that run. Regenerate this page with `make docs` "
           "(`python -m benchmarks.report`) after running a benchmark; [testing.md](testing.md) says what each "
           "benchmark does and how to run it. Ratios measured in one run (configurations taking turns, so machine "
           "noise hits all alike) are the numbers to compare; absolute tokens/s depend on the machine and its "
           "load.", "", "## Headline: megazero against DDP, FSDP2 and DeepSpeed", "", headline(results), "",
           "## Contents", ""]
    for s in SECTIONS:
        state = "" if s.result in results else " (not run on this machine)"
        out.append(f"- [{s.title}](#{anchor(s.title)}){state}")
    out.append("")
    for s in SECTIONS:
        known.add(s.result)
        out += [f"## {s.title}", "", s.what, ""]
        r = results.get(s.result)
        if r is None:
            command = f"python benchmarks/{s.script}" + (f" {s.how}" if s.how else "")
            out += [f"Not run on this machine (no result file); `{command}` writes it.", ""]
        else:
            out += [provenance(r), "", s.render(r), ""]
        for pattern in s.variants:
            for path in sorted(glob.glob(os.path.join(results_dir, pattern))):
                name = os.path.basename(path)[:-5]
                if name in known:
                    continue
                known.add(name)
                out += [f"### {name}", "", provenance(results[name]), "", render_generic(results[name]), ""]
    others = [name for name in results if name not in known]
    if others:
        out += ["## Other results", ""]
        for name in others:
            out += [f"### {name}", "", provenance(results[name]), "", render_generic(results[name]), ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=RESULTS, help="the directory of result JSON files")
    parser.add_argument("--out", default=PAGE, help="the page to write")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out differs")
    args = parser.parse_args(argv)
    text = generate(args.results)
    if args.check:
        current = open(args.out).read() if os.path.exists(args.out) else None
        if current != text:
            print(f"{args.out} is not what `python -m benchmarks.report` generates from {args.results}: "
                  "run `make docs`", file=sys.stderr)
            return 1
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(args.out, REPO) if args.out.startswith(REPO) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
