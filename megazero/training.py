"""What the pretraining recipes share, as helpers their loops call: start a run (threads, process
group, model-parallel grid, seed, tokenizer), build and resume the engine of the run config, the
header line, progress lines and scalars (ProgressLog), the stop checks (RunStop), evaluation over
blends, save-or-stop, the end-of-run sample and the run's end.

A recipe (scripts/pretrain_gpt.py, pretrain_llama.py, pretrain_bert.py) holds its own loop, top to
bottom: run config (megazero.config.cli.parse_run), model, data, engine, then `while` steps remain:
engine.train_batch -> log -> evaluate -> save -> stop checks. Nothing here knows a model family or
calls back into a recipe.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import signal
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

import megazero
from megazero import parallel_state
from megazero.accelerator import get_accelerator
from megazero.config import ConfigError, resolve_batch_triad
from megazero.config.cli import describe, save_run_config
from megazero.config.run import BatchRampup, RunConfig
from megazero.data import DistributedBatchLoader, Tokenizer, build_tokenizer
from megazero.data.data_paths import DataSplits, build_splits
from megazero.distributed import all_reduce_values
from megazero.moe import has_moe_layers, moe_stats
from megazero.profiling import measure_peak_flops
from megazero.profiling.throughput import peak_cache_path
from megazero.watchdog import watched

RUN_CONFIG_FILE = "run_config.json"


def start_run(run: RunConfig):
    """Threads, process group, model-parallel grid (the parallel section, checked against the world
    size), seed and tokenizer: (rank, grid, tokenizer)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    megazero.init_distributed()
    parallel = run.parallel
    try:
        parallel.data_parallel_size(dist.get_world_size())
    except ConfigError as e:  # one line per rank naming the flags, not a traceback
        raise SystemExit(f"[megazero] rank {dist.get_rank()}: {e}") from None
    grid = parallel_state.initialize_model_parallel(parallel.tensor_model_parallel_size,
                                                    parallel.pipeline_model_parallel_size,
                                                    parallel.expert_model_parallel_size,
                                                    parallel.context_parallel_size)
    megazero.set_seed(run.seed)
    spec = run.data.tokenizer_spec()
    try:
        tokenizer = build_tokenizer(spec)
    except (FileNotFoundError, ValueError) as e:
        hint = " (`make data` builds a sentencepiece model beside its data)" if spec.type == "sentencepiece" else ""
        raise SystemExit(f"[megazero] rank {dist.get_rank()}: tokenizer {spec.describe()}: {e}{hint}") from None
    return dist.get_rank(), grid, tokenizer


def pipeline_options(run: RunConfig) -> dict:
    """models.parallelize.parallelize's pipeline arguments of the run: the layers per virtual stage,
    the schedule (zbv's chunks are laid out in a V), the partition method (engine keys pipeline.*,
    which the flags set) and the micro-batches per step an interleaved split is chosen for (None
    where the batch triad does not resolve: the engine then stops on it, naming the file)."""
    pipeline = run.engine_config().pipeline
    engine = run.engine
    dp = run.parallel.data_parallel_size(dist.get_world_size()) if dist.is_initialized() else 1
    try:
        micro = resolve_batch_triad(engine.get("train_batch_size"), engine.get("train_micro_batch_size_per_gpu"),
                                    engine.get("gradient_accumulation_steps"), dp)[2]
    except ConfigError:
        micro = None
    return {"num_layers_per_virtual_stage": pipeline.num_layers_per_virtual_stage,
            "partition_method": pipeline.partition_method or "parameters", "num_microbatches": micro,
            "pipeline_schedule": pipeline.schedule}


def build_engine(run: RunConfig, model: torch.nn.Module, train_data, lr_scheduler=None):
    """megazero.initialize over `model` (this rank's part) and `train_data` with the run's engine
    config: (engine, training loader). `lr_scheduler`: a schedule of your own, or a callable taking
    the optimizer (initialize's; None: the engine config's `scheduler`). A bad engine config stops
    the run with one line naming the file and the key."""
    model = model.to(get_accelerator().current_device_name())
    try:
        engine, _, loader, _ = megazero.initialize(model=model, model_parameters=param_groups(model),
                                                   training_data=train_data, config=copy.deepcopy(run.engine),
                                                   lr_scheduler=lr_scheduler, mpu=parallel_state)
    except ConfigError as e:
        raise SystemExit(f"[megazero] rank {dist.get_rank()}: engine config {run.engine_file} (with the recipe's "
                         f"flags applied): {e}") from None
    return engine, loader


def resume(engine, checkpoint, rank: int, train_iters: int) -> None:
    """Load --load's latest checkpoint where there is one (a first run says so in one line, and a
    checkpoint already at --train-iters too)."""
    if not checkpoint.load:
        return
    if not os.path.exists(os.path.join(checkpoint.load, "latest")):
        if rank == 0:
            print(f"no checkpoint in {checkpoint.load} yet: starting from scratch", flush=True)
        return
    path, _ = engine.load_checkpoint(checkpoint.load, fallback=checkpoint.load_fallback)
    if path and rank == 0:
        print(f"resumed from {path} at iteration {engine.global_steps}", flush=True)
        if engine.global_steps >= train_iters:
            print(f"nothing to train: the checkpoint is at iteration {engine.global_steps} and --train-iters is "
                  f"{train_iters} (raise it, or --load another directory or None to start afresh)", flush=True)


def publish_run_config(run: RunConfig, engine, rank: int) -> None:
    """Print the resolved run config once, and write it as run_config.json beside the TensorBoard
    events (every checkpoint holds it too, in its client state): `--config` that file runs it again."""
    if rank != 0:
        return
    print("run config:\n" + describe(run), flush=True)
    if engine.config.tensorboard.enabled:
        board = engine.config.tensorboard
        save_run_config(run, os.path.join(board.output_path, board.job_name, RUN_CONFIG_FILE))


def header(engine, grid, name: str, num_params: int, details: str = "", active_params: int | None = None) -> str:
    """The run's header line: "<name>: <params> parameters [(<active> active per token)], <ranks> =
    TP x PP [x CP (comm)] x DP [(EP)], batch = micro x accumulation x DP, <dtype>[, <details>][, ZeRO ...]"."""
    ep = f" (EP {grid.expert_model_parallel_size})" if grid.expert_model_parallel_size > 1 else ""
    cp = (f" x CP {grid.context_parallel_size} ({getattr(engine.module.config, 'cp_comm_type', 'p2p')})"
          if grid.context_parallel_size > 1 else "")
    active = f" ({active_params:,} active per token)" if active_params not in (None, num_params) else ""
    extra = f", {details}" if details else ""
    return (f"{name}: {num_params:,} parameters{active}, {dist.get_world_size()} ranks = TP "
            f"{grid.tensor_model_parallel_size} x PP {grid.pipeline_model_parallel_size}{cp} x DP "
            f"{grid.sample_shards}{ep}, batch {engine.train_batch_size()} = "
            f"{engine.train_micro_batch_size_per_gpu()} x {engine.gradient_accumulation_steps()} x "
            f"{engine.sample_shards}, {engine.config.compute_dtype}{extra}{zero_summary(engine.config)}")


def peak_flops(engine, run: RunConfig, model: torch.nn.Module) -> float:
    """Per-rank peak FLOP/s for MFU: --peak-flops, else a short matmul probe (cached)."""
    return run.logging.peak_flops or measure_peak_flops(engine.config.compute_dtype, seconds=0.3,
                                                        device=next(model.parameters()).device)


def batch_rampup(run: RunConfig, engine) -> BatchRampup | None:
    """The run's --rampup-batch-size (None without one), ramping to the engine's global batch."""
    if run.schedule.rampup_batch_size is None:
        return None
    start, increment, samples = run.schedule.rampup_batch_size
    try:
        return BatchRampup(start, increment, samples, engine.train_batch_size(),
                           engine.train_micro_batch_size_per_gpu() * engine.sample_shards)
    except ConfigError as e:
        raise SystemExit(f"[megazero] rank {dist.get_rank()}: {e}") from None


class RunStop:
    """Why the run stops after this iteration, agreed by every rank: "signal" (SIGTERM/SIGUSR1:
    Slurm's pre-timeout signal, preemption, scancel), "time" (--exit-duration-in-mins of training
    in this run) or None."""

    def __init__(self, minutes: float | None):
        self.minutes = minutes
        self.start = time.perf_counter()
        self.signal = StopSignal()

    def reason(self) -> str | None:
        """A collective: every rank must stop at the same iteration."""
        out_of_time = self.minutes is not None and time.perf_counter() - self.start > 60 * self.minutes
        timed_out, signalled = all_reduce_values([float(out_of_time), float(self.signal.received is not None)], "max")
        return "signal" if signalled else "time" if timed_out else None

    def announce(self, reason: str, it: int, rank: int) -> None:
        """The line that says why the run stopped early."""
        if rank != 0:
            return
        if reason == "time":
            print(f"time budget of {self.minutes} min reached at iteration {it}", flush=True)
        else:
            print(f"received {signal.Signals(self.signal.received).name}: checkpoint saved at iteration {it}, "
                  f"exiting", flush=True)

    def close(self) -> None:
        """Put back the signal handlers there were before."""
        self.signal.restore()


def finish_run(engine) -> None:
    """Close the monitors, wait for every rank, and end the process group."""
    engine.monitor.close()
    end_of_run_barrier()
    dist.destroy_process_group()


def zero_summary(config) -> str:
    """", ZeRO-<stage>[, offload optimizer <device>][, offload params <device>]" for the header
    line; "" at stage 0."""
    zero = config.zero_optimization
    if zero.stage == 0:
        return ""
    offloads = [f"offload {what} {section.device}" for what, section in
                (("optimizer", zero.offload_optimizer), ("params", zero.offload_param)) if section.device != "none"]
    return ", ".join([f", ZeRO-{zero.stage}", *offloads])


def _layer_range(layers: range) -> str:
    """Layers as written inclusively: "4-8", "9" for one layer."""
    last = layers.stop - 1
    return f"{layers.start}" if last == layers.start else f"{layers.start}-{last}"


def pipeline_split(model: torch.nn.Module, grid, method: str, transport: str | None = None,
                   schedule: str = "1f1b") -> str:
    """At PP > 1, the line that says how the layers were split and how messages travel (a
    collective over each pipeline): each stage's layers (inclusive), or with v model chunks each
    stage's chunks, e.g. "pipeline: 2 stages x 2 model chunks, split measured: layers [0-3, 9-13 |
    4-8, 14-15], p2p through shared memory"; the schedule where it is not 1f1b ("pipeline: 2
    stages, schedule zb-h1, ..."); "" at PP = 1. `transport`: pipeline.p2p_transport."""
    from megazero.pipeline.chunks import ModelChunks
    from megazero.pipeline.p2p import choose_transport

    stages = grid.pipeline_model_parallel_size
    if stages == 1:
        return ""
    chunks = list(model.chunks) if isinstance(model, ModelChunks) else [model]
    mine = ", ".join(_layer_range(c.layers) for c in chunks)
    # the link to the next stage (the last stage's to its previous one): the choice StageLinks makes
    peer = grid.pp_ranks[grid.pp_rank + 1 if grid.pp_rank + 1 < stages else grid.pp_rank - 1]
    device = next(model.parameters()).device
    way = choose_transport(transport, device, dist.get_rank(), peer)
    everyone = [None] * stages
    dist.all_gather_object(everyone, (mine, way), group=grid.pp_group)
    shape = f"{stages} stages x {len(chunks)} model chunks" if len(chunks) > 1 else f"{stages} stages"
    if isinstance(model, ModelChunks) and model.layout != "loop":
        shape += f" in a {model.layout.upper()}"
    if schedule != "1f1b":
        shape += f", schedule {schedule}"
    ways = {w for _, w in everyone}
    p2p = "shared memory" if ways == {"shm"} else "the process group" if ways == {"backend"} else \
        "shared memory and the process group"
    return f"pipeline: {shape}, split {method}: layers [{' | '.join(m for m, _ in everyone)}], p2p through {p2p}"


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Weight decay on matrices only (not on biases, LayerNorm or positions' 1-D params)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def evaluate(engine, dataset, iters: int, measure: Callable[[dict], dict] | None = None) -> dict[str, float]:
    """Per-micro-batch means, over all data-parallel ranks, of measure(batch) (a dict of scalars;
    default {"loss": engine.eval_batch(batch)}) over the first iters micro-batches per rank of
    `dataset`, in eval mode."""
    measure = measure or (lambda batch: {"loss": engine.eval_batch(batch)})
    engine.eval()
    micro = engine.train_micro_batch_size_per_gpu()
    samples = min(len(dataset), iters * micro * engine.sample_shards)
    loader = DistributedBatchLoader(dataset, micro, engine.sample_shard, engine.sample_shards, num_samples=samples)
    sums: dict[str, float] = {}
    batches = 0
    for batch in loader:
        for key, value in measure(batch).items():
            sums[key] = sums.get(key, 0.0) + float(value)
        batches += 1
    *totals, batches = all_reduce_values([*sums.values(), batches], group=engine.dp_group)
    engine.train()
    return {key: total / batches for key, total in zip(sums, totals)}


def evaluate_datasets(engine, valid, iters: int, weights: dict[str, float] | None = None,
                      measure: Callable[[dict], dict] | None = None) -> dict[str, dict[str, float]]:
    """evaluate() of each dataset of `valid` ({name: dataset}; a lone dataset, or the only one, is
    named ""), plus, when there are several, "" for their mean weighted by `weights` (default: equal)."""
    if not isinstance(valid, Mapping) or len(valid) == 1:
        valid = {"": valid if not isinstance(valid, Mapping) else next(iter(valid.values()))}
    results = {name: evaluate(engine, data, iters, measure) for name, data in valid.items()}
    if len(results) > 1:
        w = weights or {name: 1 / len(results) for name in results}
        results[""] = {key: sum(w[n] * r[key] for n, r in results.items()) for key in next(iter(results.values()))}
    return results


def average_across_ranks(value: float, group) -> float:
    """Mean of a float over the data-parallel group."""
    return all_reduce_values([value], group=group)[0] / dist.get_world_size(group)


def sample_text(model: torch.nn.Module, tokenizer: Tokenizer, prompt: str, tokens: int,
                seed: int, grid=None) -> str:
    """A short sampled continuation of `prompt` (temperature 0.8, top-k 40) by the model's
    generate(ids, max_new_tokens, temperature, top_k, vocab_size); with pipeline stages in `grid`,
    every stage of this rank's pipeline generates together (megazero.pipeline.pipelined_generate)."""
    from megazero.pipeline import pipelined_generate

    torch.manual_seed(seed)
    model.eval()
    ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long, device=next(model.parameters()).device)
    out = pipelined_generate(model, grid, ids, tokens, temperature=0.8, top_k=40, vocab_size=tokenizer.vocab_size)
    model.train()
    return tokenizer.decode(out[0].tolist())


@watched("barrier (end of the run)")
def end_of_run_barrier() -> None:
    """Every rank done with the run (a watched operation: a rank that never arrives, e.g. one left in
    a collective its peers skipped, is a deadlock the watchdog names instead of a silent hang)."""
    dist.barrier()


def _pipeline_moe_group(engine):
    """The pipeline group over which moe_stats covers every stage's MoE layers, where some stage
    holds one (agreed once: a stage may hold none); None without pipelining or MoE layers."""
    grid = engine.grid
    if grid is None or grid.pipeline_model_parallel_size == 1:
        return None
    [has_moe] = all_reduce_values([float(has_moe_layers(engine.module))], "max", grid.pp_group)
    return grid.pp_group if has_moe else None


class StopSignal:
    """Remembers a SIGTERM/SIGUSR1 (Slurm's pre-timeout signal, preemption, scancel) so the loop can
    save a checkpoint and exit cleanly at the next iteration boundary."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.received: int | None = None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in signals}

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def restore(self) -> None:
        """Put back the handlers there were before (a recipe run in-process, as tests do, must not
        leave its own: processes forked later inherit it, and Pool.terminate()'s SIGTERM would no
        longer stop them)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class ProgressLog:
    """Megatron-style console lines and TensorBoard/wandb scalars, every log_interval iterations."""

    def __init__(self, engine, schedule, seq_length: int, flops_per_token: float, peak_flops: float, rank: int,
                 show_batch: bool = False):
        self.engine, self.schedule, self.seq_length, self.rank = engine, schedule, seq_length, rank
        self.show_batch = show_batch  # a batch ramp-up: the line says the global batch
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.losses: list[float] = []
        self.moe: list[dict[str, float]] = []  # moe_stats of each iteration of the window (MoE models only)
        self.moe_group = _pipeline_moe_group(engine)
        self.window_start = time.perf_counter()
        self._start_window_counts()
        self.run_start_iter = engine.global_steps
        self.run_start = time.perf_counter()
        self.warned_mfu = False

    def _start_window_counts(self) -> None:
        self.skipped_before, self.nan_before = self.engine.skipped_steps, self.engine.nan_steps
        self.samples_before = self.engine.global_samples

    @contextlib.contextmanager
    def paused(self):
        """Time in the block (evaluation, saving) is not iteration time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.window_start += time.perf_counter() - start

    def record(self, loss: float) -> None:
        """Add this iteration's loss; at the end of a log interval, print and log the window."""
        self.losses.append(loss)
        stats = moe_stats(self.engine.module, self.moe_group)
        if stats:
            self.moe.append(stats)
        it = self.engine.global_steps
        if it % self.schedule.log_interval and it != self.schedule.train_iters:
            return
        elapsed = time.perf_counter() - self.window_start
        iters = len(self.losses)
        loss_avg = average_across_ranks(sum(self.losses) / iters, self.engine.dp_group)
        tokens_per_s = (self.engine.global_samples - self.samples_before) * self.seq_length / elapsed
        tflops_per_rank = tokens_per_s * self.flops_per_token / dist.get_world_size() / 1e12
        mfu = tflops_per_rank * 1e12 / self.peak_flops
        done = it - self.run_start_iter
        eta = (time.perf_counter() - self.run_start) / max(done, 1) * (self.schedule.train_iters - it)
        budget = self.schedule.exit_duration_in_mins
        if budget is not None:  # the run stops at its time budget if that comes first
            eta = max(0.0, min(eta, 60 * budget - (time.perf_counter() - self.run_start)))
        # Megatron's per-interval counts: skipped steps, and of those the inf/nan gradients that no
        # dynamic loss scale explains (fp32, bf16)
        skipped = self.engine.skipped_steps - self.skipped_before
        nans = self.engine.nan_steps - self.nan_before
        moe = self._moe_window()
        moe_line = "".join(f" | {name}: {value:.4g}" for name, value in moe.items())
        if self.rank == 0:
            grad_norm = self.engine.last_grad_norm or 0.0
            batch = f"global batch size: {self.engine.train_batch_size():5d} | " if self.show_batch else ""
            print(f" iteration {it:6d}/{self.schedule.train_iters} | "
                  f"consumed samples {self.engine.global_samples:8d} | {batch}"
                  f"elapsed time per iteration (ms): {1000 * elapsed / iters:7.1f} | lm loss: {loss_avg:.4f} | "
                  f"learning rate: {self.engine.get_lr()[0]:.3e} | loss scale: {self.engine.get_loss_scale():g} | "
                  f"grad norm: {grad_norm:.3f} | number of skipped iterations: {skipped:3d} | "
                  f"number of nan iterations: {nans:3d} | "
                  f"tokens/s: {tokens_per_s:,.0f} | TFLOP/s per rank: {tflops_per_rank:.3f} | MFU: {100 * mfu:.1f}% | "
                  f"ETA: {eta / 60:.1f} min{moe_line}", flush=True)
            if mfu > 1 and not self.warned_mfu:  # the cached peak was measured while the machine was busy
                self.warned_mfu = True
                print(f"[megazero] MFU above 100%: the matmul peak ({self.peak_flops / 1e9:.1f} GFLOP/s per rank) is "
                      f"too low; delete {peak_cache_path()} to measure it again on a quiet machine, or pass "
                      f"--peak-flops", flush=True)
        self.engine.monitor.write(it, {
            "lm loss": loss_avg, "learning-rate": self.engine.get_lr()[0],
            "loss-scale": self.engine.get_loss_scale(), "grad-norm": self.engine.last_grad_norm or 0.0,
            "skipped-iterations": skipped, "nan-iterations": nans,
            "iteration-time": elapsed / iters, "throughput/tokens-per-sec": tokens_per_s,
            "throughput/tflops-per-rank": tflops_per_rank, "throughput/mfu": mfu, **moe,
            **({"batch-size": self.engine.train_batch_size()} if self.show_batch else {})})
        self.losses, self.moe = [], []
        self.window_start = time.perf_counter()
        self._start_window_counts()


    def _moe_window(self) -> dict[str, float]:
        """The MoE scalars of the window (none for a dense model): the weighted load-balancing loss
        (and the z-loss when it is on), summed over the MoE layers of every stage, and the fraction of
        routing assignments dropped, each the mean of the iterations' last micro-batches; the fewest
        and most tokens routed to one expert in any layer and iteration. The values of this rank's
        expert-parallel group (every EP rank has the same)."""
        if not self.moe:
            return {}
        n = len(self.moe)
        out = {"moe aux loss": sum(s["load_balancing"] for s in self.moe) / n}
        z = sum(s["z_loss"] for s in self.moe) / n
        if z:
            out["moe z loss"] = z
        out["moe dropped fraction"] = sum(s["dropped_fraction"] for s in self.moe) / n
        out["moe tokens per expert min"] = min(s["tokens_per_expert_min"] for s in self.moe)
        out["moe tokens per expert max"] = max(s["tokens_per_expert_max"] for s in self.moe)
        return out


def build_datasets(run: RunConfig, make: Callable[[object, str], object], kind: str = "document",
                   description: dict | None = None) -> DataSplits:
    """The run's datasets from --data-path/--split or --{train,valid,test}-data-path: make(indexed
    data, "train"/"valid"/"test") builds each; several train datasets are blended by weight, over a
    block of --train-iters x global batch samples (every rank builds the same blend; rank 0 caches
    it under the data directory first)."""
    engine = run.engine
    dp = run.parallel.data_parallel_size(dist.get_world_size()) if dist.is_initialized() else 1
    try:
        batch, _, _ = resolve_batch_triad(engine.get("train_batch_size"), engine.get("train_micro_batch_size_per_gpu"),
                                          engine.get("gradient_accumulation_steps"), dp)
    except ConfigError:
        batch = 1  # build_engine stops with the config error, naming the file, before any step
    return build_splits(run.data, kind, make, max(1, run.schedule.train_iters) * batch,
                        {"seed": run.seed, "seq_length": getattr(run.model, "seq_length", None), **(description or {})})


def run_evaluation(engine, valid, eval_iters: int, rank: int, unigram: float | None,
                   weights: dict[str, float] | None = None, label: str = "validation") -> float:
    """Evaluate the mean loss on `valid` (a dataset, or {name: dataset}: then each one's loss too,
    as `lm loss validation/<name>`, and their mean weighted by `weights`) over `eval_iters`
    micro-batches per rank; print and log it with its perplexity (and, when known, the data's
    unigram entropy to compare with). `label` "test": the same for the test datasets."""
    results = evaluate_datasets(engine, valid, eval_iters, weights)
    it = engine.global_steps
    scalars = {}
    for name, result in results.items():
        if name:
            scalars[f"lm loss {label}/{name}"] = result["loss"]
            if rank == 0:
                print(f" {label} at iteration {it} | {name} | lm loss: {result['loss']:.4f} | "
                      f"lm loss PPL: {math.exp(result['loss']):.2f}", flush=True)
    loss = results[""]["loss"]
    if rank == 0:
        ref = f" (unigram entropy {unigram:.3f})" if unigram is not None else ""
        print(f" {label} at iteration {it} | lm loss: {loss:.4f} | lm loss PPL: {math.exp(loss):.2f}{ref}",
              flush=True)
    engine.monitor.write(it, {f"lm loss {label}": loss, f"lm loss {label} ppl": math.exp(loss), **scalars})
    engine.monitor.flush()
    return loss


def print_sample(model: torch.nn.Module, tokenizer: Tokenizer, sample, seed: int, grid,
                 rank: int, partitioned: bool = False) -> None:
    """Rank 0 prints a sample of `sample.sample_tokens` after `sample.sample_prompt`; under tensor
    parallelism its TP peers (and its expert-parallel peers) generate alongside (the forward has
    collectives), and with pipeline stages the other stages of its pipeline (and theirs) pass the
    activations on. `partitioned` (ZeRO-3: each forward all-gathers its parameters over the
    data-parallel group): every data-parallel rank generates alongside."""
    # with expert parallelism the MoE layers' all-to-alls need the EP peers of DP rank 0 (DP ranks
    # 0..EP-1): they generate the same text alongside it
    if grid.context_parallel_size > 1:  # the model attends over its CP group: it generates at CP 1
        if rank == 0:
            print("(no sample at context_parallel_size > 1: scripts/generate.py on the checkpoint generates at CP 1)",
                  flush=True)
        return
    if not partitioned and grid.dp_rank >= grid.expert_model_parallel_size:
        return
    text = sample_text(model, tokenizer, sample.sample_prompt, sample.sample_tokens, seed, grid)
    if rank == 0:
        print("----- sample -----\n" + text + "\n------------------", flush=True)


def save_or_stop(engine, run: RunConfig, it: int, rank: int, last: bool = False) -> None:
    """Save a checkpoint at iteration `it` in --save, the run config in it. A failed save (every rank
    raises the same error, naming the file and the errno; the previous checkpoint stays) stops the
    run with that message, or with --continue-on-save-failure is printed as a warning and training
    goes on. The run's last save (`last`: nothing follows to retry it) always stops with the error:
    the run must not exit 0 without its final state."""
    from megazero.checkpoint import CheckpointError

    save = run.checkpoint.save
    try:
        path = engine.save_checkpoint(save, client_state={"iteration": it, "run_config": run.to_dict()})
        if rank == 0:
            print(f"saved checkpoint {path} at iteration {it}", flush=True)
    except CheckpointError as e:
        if last:
            raise SystemExit(f"checkpoint save failed at iteration {it}, the run's last save (the last complete "
                             f"checkpoint in {save}, if any, is what `latest` names): {e}") from e
        if not run.checkpoint.continue_on_save_failure:
            raise SystemExit(f"checkpoint save failed at iteration {it}: {e}") from e
        if rank == 0:
            print(f"WARNING: checkpoint save failed at iteration {it}, training continues "
                  f"(--continue-on-save-failure): {e}", flush=True)
