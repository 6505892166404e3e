"""The recipe loop as a library: Megatron-style flags, the engine config they overlay, the train/eval
loop with its progress lines and ETA, preemption signals, evaluation and sampling.

A pretraining script (scripts/pretrain_gpt.py, pretrain_bert.py) reads top to bottom: flags
(`recipe_parser`), model, data, then `train(...)` with its hooks: `validate(engine)` (evaluate,
print, log; returns the validation loss), `finish(engine, last validation loss, stop reason)` (what
the run does at the end; returns the script's result) and `details(peak)` (the end of the header
line). Nothing here knows a model family: the script builds the model and the datasets.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

import megazero
from megazero import parallel_state
from megazero.config import ConfigError, load_config_source, resolve_batch_triad, validate_config
from megazero.data import DistributedBatchLoader, SentencePieceTokenizer
from megazero.data.blended_dataset import parse_data_path
from megazero.data.data_paths import DataSplits, build_splits, first_prefix
from megazero.distributed import all_reduce_values
from megazero.moe import has_moe_layers, moe_stats
from megazero.profiling import measure_peak_flops
from megazero.profiling.throughput import peak_cache_path
from megazero.watchdog import watched


def default_tokenizer(prefix: str) -> str:
    """The tokenizer of data prefix P: P_tokenizer.model, else the one P_stats.json names (an output
    of --output-per-input or --partitions), else that of P without _text_document/_text_sentence."""
    candidates = [prefix] + [prefix[:-len(s)] for s in ("_text_document", "_text_sentence") if prefix.endswith(s)]
    for p in candidates:
        if os.path.isfile(p + "_tokenizer.model"):
            return p + "_tokenizer.model"
        if os.path.isfile(p + "_stats.json"):
            with open(p + "_stats.json") as f:
                named = json.load(f).get("tokenizer_model")
            if named and os.path.isfile(named):
                return named
    return prefix + "_tokenizer.model"


class RecipeParser(argparse.ArgumentParser):
    """An ArgumentParser that fills --tokenizer-model's default (default_tokenizer() of the first
    data prefix) and requires --data-path or --train-data-path."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        if hasattr(parsed, "data_path"):
            if bool(parsed.data_path) == bool(parsed.train_data_path):
                self.error("give one of --data-path (with --split) or --train-data-path (with --valid-data-path)")
            for split in ("", "train", "valid", "test"):  # a malformed list: a usage error, not a traceback per rank
                values = getattr(parsed, f"{split}_data_path" if split else "data_path", None)
                if values:
                    try:
                        parse_data_path(values, f"--{split}-data-path" if split else "--data-path",
                                        unweighted=split in ("valid", "test"))
                    except ValueError as e:
                        self.error(str(e))
            if parsed.tokenizer_model is None:
                parsed.tokenizer_model = default_tokenizer(first_prefix(parsed))
        return parsed, rest


def recipe_parser(description: str, model_config: str, engine_config_path: str) -> RecipeParser:
    """Megatron-style flags shared by the recipes (model size, parallelism, batch, schedule, data,
    checkpoints, logging, precision) plus the engine config flags; `model_config` and
    `engine_config_path` are the defaults of --model-config and --deepspeed_config."""
    p = RecipeParser(description=description)
    p.add_argument("--model-config", default=model_config)
    p.add_argument("--num-layers", type=int)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-attention-heads", type=int)
    p.add_argument("--seq-length", type=int)
    p.add_argument("--dropout", type=float)
    p.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="activation checkpointing: whole layers, or only the attention core")
    p.add_argument("--recompute-num-layers", type=int, default=None,
                   help="with full: the first N layers of each pipeline stage")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved 1F1B: each pipeline stage holds num_layers / (PP x this) model chunks")
    p.add_argument("--pipeline-partition-method", choices=["parameters", "compute", "measured"], default=None,
                   help="which layers each pipeline stage holds: balanced by parameter count (default), by "
                        "forward FLOPs with the output layer and loss counted (fewer layers on the last stage), or "
                        "by the forward + backward time of a layer, the embeddings and the head measured at build "
                        "time")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="split LayerNorm/dropout activations along the sequence across tensor-parallel ranks")
    p.add_argument("--micro-batch-size", type=int, help="overrides train_micro_batch_size_per_gpu")
    p.add_argument("--global-batch-size", type=int, help="overrides train_batch_size")
    p.add_argument("--train-iters", type=int, default=500)
    p.add_argument("--train-minutes", type=float, default=None,
                   help="stop (saving a checkpoint) after this much training time in this run")
    p.add_argument("--lr", type=float, help="overrides the optimizer's lr")
    p.add_argument("--data-path", nargs="+", default=None,
                   help="prefix P of P_train_text_document and P_valid_text_document (.bin/.idx), or of one "
                        "dataset cut by --split; or weight-prefix pairs W1 P1 W2 P2 ... to blend (weights normalised)")
    p.add_argument("--split", default="969,30,1",
                   help="train,valid,test weights cutting a one-dataset --data-path prefix by documents")
    for split in ("train", "valid", "test"):
        p.add_argument(f"--{split}-data-path", nargs="+", default=None,
                       help=f"the {split} datasets: one prefix or weight-prefix pairs"
                       + ("" if split == "train" else " or prefixes (each reported apart)")
                       + ", instead of --data-path")
    p.add_argument("--tokenizer-model", default=None, help="default: P_tokenizer.model of the first prefix")
    p.add_argument("--save", default=None)
    p.add_argument("--load", default=None)
    p.add_argument("--load-fallback", action="store_true",
                   help="if --load's `latest` is corrupt, load the previous complete tag (with a warning)")
    p.add_argument("--continue-on-save-failure", action="store_true",
                   help="a failed checkpoint save (e.g. a full disk) warns and training goes on (default: stop)")
    p.add_argument("--save-interval", type=int, default=100)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--tensorboard-dir", default=None)
    p.add_argument("--wandb", action="store_true", help="log to wandb (offline unless WANDB_API_KEY is set)")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true")
    precision.add_argument("--fp16", action="store_true")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--peak-flops", type=float, default=None,
                   help="per-rank peak FLOP/s for MFU (default: measured by a matmul probe)")
    p.add_argument("--watchdog-timeout", type=float, default=None,
                   help="seconds a collective may wait for a stopped, dead or deadlocked rank before the ranks "
                        "not arrived are named and the job exits (0: watchdog off; default: the config's)")
    megazero.add_config_arguments(p)
    p.set_defaults(megazero_config=engine_config_path)
    return p


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """--sample-prompt and --sample-tokens, the text print_sample() continues at the end of a run."""
    parser.add_argument("--sample-prompt", default="ROMEO:\n")
    parser.add_argument("--sample-tokens", type=int, default=120)


def add_moe_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron's mixture-of-experts flags (GPT and Llama: every --moe-layer-freq-th layer's MLP
    becomes --num-experts experts, split over --expert-model-parallel-size data-parallel ranks);
    `moe_overrides` gives the model-config fields they set."""
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, help="experts per MoE layer (default: the config's; none: dense)")
    g.add_argument("--moe-router-topk", type=int, help="experts per token, 1 or 2 (default: the config's, else 2)")
    g.add_argument("--moe-layer-freq", type=int, help="every Nth layer (0, N, 2N, ...) is an MoE layer (default 1)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="ranks the experts are split over; divides the data-parallel size")
    g.add_argument("--moe-capacity-factor", type=float,
                   help="each expert keeps at most factor x tokens x topk / experts routings (default: dropless)")
    g.add_argument("--moe-aux-loss-coeff", type=float, help="load-balancing loss weight (default: the config's, 0.01)")
    g.add_argument("--moe-z-loss-coeff", type=float, help="router z-loss weight (default: the config's, 0)")
    g.add_argument("--moe-router-score-order", choices=("softmax_topk", "topk_softmax"),
                   help="softmax over all experts then top-k (default: the config's, softmax_topk), or softmax over "
                        "the top-k logits (Megatron's default; Mixtral's routing, which export_hf needs)")


def moe_overrides(args: argparse.Namespace) -> dict:
    """The model-config fields add_moe_arguments' flags set (None keeps the JSON's)."""
    return {"num_experts": args.num_experts, "moe_router_topk": args.moe_router_topk,
            "moe_layer_freq": args.moe_layer_freq, "moe_capacity_factor": args.moe_capacity_factor,
            "moe_aux_loss_coeff": args.moe_aux_loss_coeff, "moe_z_loss_coeff": args.moe_z_loss_coeff,
            "moe_router_score_order": args.moe_router_score_order}


def model_overrides(args: argparse.Namespace) -> dict:
    """The model-config fields the shared flags set, for ModelConfig.from_json (None keeps the JSON's)."""
    return {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
            "num_attention_heads": args.num_attention_heads, "seq_length": args.seq_length,
            "dropout": args.dropout, "recompute_granularity": args.recompute_granularity,
            "recompute_num_layers": args.recompute_num_layers,
            "tensor_model_parallel_size": args.tensor_model_parallel_size,
            "sequence_parallel": args.sequence_parallel or None}


def engine_config(args: argparse.Namespace) -> dict:
    """The engine JSON with the Megatron-style flags applied on top."""
    config = load_config_source(args.megazero_config)
    if args.micro_batch_size is not None:
        config["train_micro_batch_size_per_gpu"] = args.micro_batch_size
    if args.global_batch_size is not None:
        config["train_batch_size"] = args.global_batch_size
    if args.lr is not None:
        config.setdefault("optimizer", {"type": "AdamW", "params": {}}).setdefault("params", {})["lr"] = args.lr
        scheduler = config.get("scheduler", {})
        if scheduler.get("type") in ("WarmupLR", "WarmupDecayLR"):
            scheduler["params"]["warmup_max_lr"] = args.lr
    if config.get("scheduler", {}).get("type") in ("WarmupDecayLR", "WarmupCosineLR"):
        config["scheduler"]["params"]["total_num_steps"] = args.train_iters
    if args.bf16 or args.fp16:
        config.pop("bfloat16", None)  # the flag decides; the old spelling must not contradict it
    if args.bf16:
        config["bf16"] = {"enabled": True}
        config.pop("fp16", None)
    if args.fp16:
        config["fp16"] = {**config.get("fp16", {}), "enabled": True}
        config.pop("bf16", None)
    if args.tensorboard_dir:
        config["tensorboard"] = {"enabled": True, "output_path": args.tensorboard_dir, "job_name": ""}
    if args.wandb:
        config["wandb"] = {**config.get("wandb", {}), "enabled": True}
    if getattr(args, "watchdog_timeout", None) is not None:  # 0: off
        config["watchdog"] = {"enabled": args.watchdog_timeout > 0, "timeout": args.watchdog_timeout or 60.0}
    _virtual_stage_flag(args, config)
    return config


def _virtual_stage_flag(args: argparse.Namespace, config: dict) -> None:
    """--num-layers-per-virtual-pipeline-stage into the config's pipeline.num_layers_per_virtual_stage:
    the flag and the key name one setting, so given both they must agree."""
    flag = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if flag is None:
        return
    block = config.get("pipeline")
    key = block.get("num_layers_per_virtual_stage") if isinstance(block, dict) else None
    if key is not None and key != flag:
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {flag} and 'pipeline.num_layers_per_virtual_stage' "
                          f"{key} of {args.megazero_config} disagree; they are one setting: give one, or the same "
                          f"value")
    config["pipeline"] = {**(block if isinstance(block, dict) else {}), "num_layers_per_virtual_stage": flag}


def partition_method(args: argparse.Namespace) -> str:
    """The pipeline's stage split of the run (models.parallelize.parallelize's partition_method):
    --pipeline-partition-method, else the engine config's pipeline.partition_method, else
    "parameters"; one line naming both when they disagree."""
    flag = getattr(args, "pipeline_partition_method", None)
    try:
        config = engine_config(args)
        key = validate_config(config).pipeline.partition_method if "pipeline" in config else None
    except ConfigError as e:
        raise SystemExit(f"[megazero] rank {dist.get_rank() if dist.is_initialized() else 0}: engine config "
                         f"{args.megazero_config} (with the recipe's flags applied): {e}") from None
    explicit = key if key is not None and "partition_method" in config["pipeline"] else None
    if flag is not None and explicit is not None and flag != explicit:
        raise SystemExit(f"[megazero] --pipeline-partition-method {flag} and 'pipeline.partition_method' {explicit} "
                         f"of {args.megazero_config} disagree; they are one setting: give one, or the same value")
    return flag or explicit or "parameters"


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


def pipeline_split(model: torch.nn.Module, grid, method: str, transport: str | None = None) -> str:
    """At PP > 1, the line that says how the layers were split and how messages travel (a
    collective over each pipeline): each stage's layers (inclusive), or with v model chunks each
    stage's chunks, e.g. "pipeline: 2 stages x 2 model chunks, split measured: layers [0-3, 9-13 |
    4-8, 14-15], p2p through shared memory"; "" at PP = 1. `transport`: pipeline.p2p_transport."""
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
    ways = {w for _, w in everyone}
    p2p = "shared memory" if ways == {"shm"} else "the process group" if ways == {"backend"} else \
        "shared memory and the process group"
    return f"pipeline: {shape}, split {method}: layers [{' | '.join(m for m, _ in everyone)}], p2p through {p2p}"


def microbatches_per_step(args: argparse.Namespace) -> int | None:
    """The run's micro-batches per step on each pipeline (gradient_accumulation_steps, from the
    engine config's batch triad with the recipe's flags): what parallelize chooses an interleaved
    split for. None where the triad does not resolve (train() then stops on it, naming the file)."""
    config = engine_config(args)
    dp = dist.get_world_size() // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size) \
        if dist.is_initialized() else 1
    try:
        return resolve_batch_triad(config.get("train_batch_size"), config.get("train_micro_batch_size_per_gpu"),
                                   config.get("gradient_accumulation_steps"), dp)[2]
    except ConfigError:
        return None


def virtual_stage_layers(args: argparse.Namespace) -> int | None:
    """The layers per virtual pipeline stage of the run: --num-layers-per-virtual-pipeline-stage or
    the engine config's pipeline.num_layers_per_virtual_stage (one line naming both when they
    disagree); start_run() sets the flag's attribute to it, which the recipes build the model with."""
    try:
        config = engine_config(args)
        # validated here only with the block (else train() reports any error of the config, as before)
        return validate_config(config).pipeline.num_layers_per_virtual_stage if "pipeline" in config else None
    except ConfigError as e:
        raise SystemExit(f"[megazero] rank {dist.get_rank() if dist.is_initialized() else 0}: engine config "
                         f"{args.megazero_config} (with the recipe's flags applied): {e}") from None


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Weight decay on matrices only (not on biases, LayerNorm or positions' 1-D params)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def start_run(args: argparse.Namespace):
    """Threads, process group, model-parallel grid, seed and tokenizer: (rank, grid, tokenizer)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    megazero.init_distributed()
    ep = getattr(args, "expert_model_parallel_size", 1)  # add_moe_arguments' flag (GPT, Llama)
    try:
        grid = parallel_state.initialize_model_parallel(args.tensor_model_parallel_size,
                                                        args.pipeline_model_parallel_size, ep)
    except ValueError as e:  # sizes that do not divide: one line per rank naming them, not a traceback
        raise SystemExit(f"[megazero] rank {dist.get_rank()}: --tensor-model-parallel-size "
                         f"{args.tensor_model_parallel_size}, --pipeline-model-parallel-size "
                         f"{args.pipeline_model_parallel_size}, --expert-model-parallel-size {ep}: {e}") from None
    megazero.set_seed(args.seed)
    if hasattr(args, "num_layers_per_virtual_pipeline_stage"):  # the flag, or else the engine config's key
        args.num_layers_per_virtual_pipeline_stage = virtual_stage_layers(args)
    return dist.get_rank(), grid, SentencePieceTokenizer(args.tokenizer_model)


@torch.no_grad()
def evaluate(engine, dataset, iters: int, measure: Callable[[dict], dict] | None = None) -> dict[str, float]:
    """Per-micro-batch means, over all data-parallel ranks, of measure(batch) (a dict of scalars;
    default {"loss": engine.eval_batch(batch)}) over the first iters micro-batches per rank of
    `dataset`, in eval mode."""
    measure = measure or (lambda batch: {"loss": engine.eval_batch(batch)})
    engine.eval()
    micro = engine.train_micro_batch_size_per_gpu()
    samples = min(len(dataset), iters * micro * engine.dp_world_size)
    loader = DistributedBatchLoader(dataset, micro, engine.dp_rank, engine.dp_world_size, num_samples=samples)
    sums: dict[str, float] = {}
    batches = 0
    for batch in loader:
        for key, value in measure(batch).items():
            sums[key] = sums.get(key, 0.0) + float(value)
        batches += 1
    *totals, batches = all_reduce_values([*sums.values(), batches], group=engine.dp_group)
    engine.train()
    return {key: total / batches for key, total in zip(sums, totals)}


def build_datasets(args: argparse.Namespace, make: Callable[[object, str], object], kind: str = "document",
                   description: dict | None = None) -> DataSplits:
    """The run's datasets from --data-path/--split or --{train,valid,test}-data-path: make(indexed
    data, "train"/"valid"/"test") builds each; several train datasets are blended by weight, over a
    block of --train-iters x global batch samples (every rank builds the same blend; rank 0 caches
    it under the data directory first)."""
    config = engine_config(args)
    dp = dist.get_world_size() // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size) \
        if dist.is_initialized() else 1
    try:
        batch, _, _ = resolve_batch_triad(config.get("train_batch_size"),
                                          config.get("train_micro_batch_size_per_gpu"),
                                          config.get("gradient_accumulation_steps"), dp)
    except ConfigError:
        batch = 1  # train() stops with the config error, naming the file, before any step
    return build_splits(args, kind, make, max(1, args.train_iters) * batch,
                        {"seed": args.seed, "seq_length": getattr(args, "seq_length", None), **(description or {})})


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


def run_evaluation(engine, valid, args: argparse.Namespace, rank: int, unigram: float | None,
                   weights: dict[str, float] | None = None, label: str = "validation") -> float:
    """Evaluate the mean loss on `valid` (a dataset, or {name: dataset}: then each one's loss too,
    as `lm loss validation/<name>`, and their mean weighted by `weights`) over --eval-iters
    micro-batches per rank; print and log it with its perplexity (and, when known, the data's
    unigram entropy to compare with). `label` "test": the same for the test datasets."""
    results = evaluate_datasets(engine, valid, args.eval_iters, weights)
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


def average_across_ranks(value: float, group) -> float:
    """Mean of a float over the data-parallel group."""
    return all_reduce_values([value], group=group)[0] / dist.get_world_size(group)


def sample_text(model: torch.nn.Module, tokenizer: SentencePieceTokenizer, prompt: str, tokens: int,
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


def print_sample(model: torch.nn.Module, tokenizer: SentencePieceTokenizer, args: argparse.Namespace, grid,
                 rank: int, partitioned: bool = False) -> None:
    """Rank 0 prints a sample of --sample-tokens after --sample-prompt; under tensor parallelism its
    TP peers (and its expert-parallel peers) generate alongside (the forward has collectives), and
    with pipeline stages the other stages of its pipeline (and theirs) pass the activations on.
    `partitioned` (ZeRO-3: each forward all-gathers its parameters over the data-parallel group):
    every data-parallel rank generates alongside."""
    # with expert parallelism the MoE layers' all-to-alls need the EP peers of DP rank 0 (DP ranks
    # 0..EP-1): they generate the same text alongside it
    if not partitioned and grid.dp_rank >= grid.expert_model_parallel_size:
        return
    text = sample_text(model, tokenizer, args.sample_prompt, args.sample_tokens, args.seed, grid)
    if rank == 0:
        print("----- sample -----\n" + text + "\n------------------", flush=True)


def _pipeline_moe_group(engine):
    """The pipeline group over which moe_stats covers every stage's MoE layers, where some stage
    holds one (agreed once: a stage may hold none); None without pipelining or MoE layers."""
    grid = engine.grid
    if grid is None or grid.pipeline_model_parallel_size == 1:
        return None
    [has_moe] = all_reduce_values([float(has_moe_layers(engine.module))], "max", grid.pp_group)
    return grid.pp_group if has_moe else None


class ProgressLog:
    """Megatron-style console lines and TensorBoard/wandb scalars, every log_interval iterations."""

    def __init__(self, engine, args, flops_per_token: float, peak_flops: float, rank: int):
        self.engine, self.args, self.rank = engine, args, rank
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

    def record(self, loss: float) -> None:
        """Add this iteration's loss; at the end of a log interval, print and log the window."""
        self.losses.append(loss)
        stats = moe_stats(self.engine.module, self.moe_group)
        if stats:
            self.moe.append(stats)
        it = self.engine.global_steps
        if it % self.args.log_interval and it != self.args.train_iters:
            return
        elapsed = time.perf_counter() - self.window_start
        iters = len(self.losses)
        loss_avg = average_across_ranks(sum(self.losses) / iters, self.engine.dp_group)
        tokens_per_s = iters * self.engine.train_batch_size() * self.args.seq_length / elapsed
        tflops_per_rank = tokens_per_s * self.flops_per_token / dist.get_world_size() / 1e12
        mfu = tflops_per_rank * 1e12 / self.peak_flops
        done = it - self.run_start_iter
        eta = (time.perf_counter() - self.run_start) / max(done, 1) * (self.args.train_iters - it)
        budget = getattr(self.args, "train_minutes", None)
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
            print(f" iteration {it:6d}/{self.args.train_iters} | consumed samples {self.engine.global_samples:8d} | "
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
            "throughput/tflops-per-rank": tflops_per_rank, "throughput/mfu": mfu, **moe})
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


def save_or_stop(engine, args, it: int, rank: int, last: bool = False) -> None:
    """Save a checkpoint at iteration `it`. A failed save (every rank raises the same error, naming the
    file and the errno; the previous checkpoint stays) stops the run with that message, or with
    --continue-on-save-failure is printed as a warning and training goes on. The run's last save
    (`last`: nothing follows to retry it) always stops with the error: the run must not exit 0
    without its final state."""
    from megazero.checkpoint import CheckpointError

    try:
        engine.save_checkpoint(args.save, client_state={"iteration": it})
    except CheckpointError as e:
        if last:
            raise SystemExit(f"checkpoint save failed at iteration {it}, the run's last save (the last complete "
                             f"checkpoint in {args.save}, if any, is what `latest` names): {e}") from e
        if not getattr(args, "continue_on_save_failure", False):
            raise SystemExit(f"checkpoint save failed at iteration {it}: {e}") from e
        if rank == 0:
            print(f"WARNING: checkpoint save failed at iteration {it}, training continues "
                  f"(--continue-on-save-failure): {e}", flush=True)


def train_loop(engine, loader, args, log: ProgressLog, stop: StopSignal, rank: int, run_validation):
    """Train to --train-iters, validating with run_validation() every --eval-interval; returns
    (last validation loss, why it stopped early or None)."""
    data_iter = iter(loader)
    start = time.perf_counter()
    val_loss, reason = None, None
    while engine.global_steps < args.train_iters:
        loss = engine.train_batch(data_iter)
        log.record(loss.item())
        it = engine.global_steps
        out_of_time = args.train_minutes is not None and time.perf_counter() - start > 60 * args.train_minutes
        # every rank must stop at the same iteration: agree on the flags
        timed_out, signalled = all_reduce_values([float(out_of_time), float(stop.received is not None)], "max")
        reason = "signal" if signalled else "time" if timed_out else None
        paused = time.perf_counter()
        # a run stopped by its time budget still ends validated (its last loss is what it reached);
        # a signal (preemption, Slurm's time limit) leaves no time for it
        if reason != "signal" and (it % args.eval_interval == 0 or it == args.train_iters or reason == "time"):
            val_loss = run_validation()
        if args.save and (it % args.save_interval == 0 or it == args.train_iters or reason):
            save_or_stop(engine, args, it, rank, last=it == args.train_iters or reason is not None)
        log.window_start += time.perf_counter() - paused  # iteration time excludes evaluation and saving
        if reason == "time" and rank == 0:
            print(f"time budget of {args.train_minutes} min reached at iteration {it}", flush=True)
        if reason:
            break
    return val_loss, reason


def train(args: argparse.Namespace, model: torch.nn.Module, train_data, *, grid, name: str, num_params: int,
          flops_per_token: float, validate: Callable[..., float], finish: Callable[..., dict],
          details: Callable[[float], str] | None = None, active_params: int | None = None) -> dict:
    """Run a recipe: the engine over `model` (this rank's part, from the script) and `train_data`
    with the flags' engine config, resume from --load, print the header line ("<name>: <params>
    parameters [(<active_params> active per token: MoE)], <layout>, <details(peak FLOP/s)>"), train
    to --train-iters calling validate(engine) every --eval-interval, then return finish(engine, last
    validation loss or None, stop reason: None, "time" or "signal") once the process group is done with."""
    rank = dist.get_rank()
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    try:
        engine, _, loader, _ = megazero.initialize(args=args, model=model, model_parameters=param_groups(model),
                                                   training_data=train_data, config=engine_config(args),
                                                   mpu=parallel_state)
    except ConfigError as e:  # one line naming the file and the key, not a traceback per rank
        raise SystemExit(f"[megazero] rank {rank}: engine config {args.megazero_config} (with the recipe's flags "
                         f"applied): {e}") from None
    if args.load and not os.path.exists(os.path.join(args.load, "latest")):  # a first run: one plain line
        if rank == 0:
            print(f"no checkpoint in {args.load} yet: starting from scratch", flush=True)
    elif args.load:
        path, _ = engine.load_checkpoint(args.load, fallback=getattr(args, "load_fallback", False))
        if path and rank == 0:
            print(f"resumed from {path} at iteration {engine.global_steps}", flush=True)
    peak = args.peak_flops or measure_peak_flops(engine.config.compute_dtype, seconds=0.3,
                                                 device=next(model.parameters()).device)
    if rank == 0:
        extra = f", {details(peak)}" if details is not None else ""
        ep = f" (EP {grid.expert_model_parallel_size})" if grid.expert_model_parallel_size > 1 else ""
        active = f" ({active_params:,} active per token)" if active_params not in (None, num_params) else ""
        print(f"{name}: {num_params:,} parameters{active}, {dist.get_world_size()} ranks = TP "
              f"{grid.tensor_model_parallel_size} x PP {grid.pipeline_model_parallel_size} x DP "
              f"{grid.data_parallel_size}{ep}, batch {engine.train_batch_size()} = "
              f"{engine.train_micro_batch_size_per_gpu()} x {engine.gradient_accumulation_steps()} x "
              f"{engine.dp_world_size}, {engine.config.compute_dtype}{extra}{zero_summary(engine.config)}", flush=True)
    split = pipeline_split(model, grid, partition_method(args), engine.config.pipeline.p2p_transport)
    if rank == 0 and split:
        print(split, flush=True)
    stop = StopSignal()
    try:
        val_loss, reason = train_loop(engine, loader, args, ProgressLog(engine, args, flops_per_token, peak, rank),
                                      stop, rank, lambda: validate(engine))
        if reason == "signal" and rank == 0:
            print(f"received {signal.Signals(stop.received).name}: checkpoint saved at iteration "
                  f"{engine.global_steps}, exiting", flush=True)
        result = finish(engine, val_loss, reason)
        engine.monitor.close()
        end_of_run_barrier()
        dist.destroy_process_group()
    finally:
        stop.restore()
    return result
