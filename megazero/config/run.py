"""One recipe run as one typed tree: `model`, `parallel`, `training`, `schedule`, `data`,
`checkpoint`, `logging` and `engine` (the DeepSpeed-shaped engine JSON, kept as it is).

A setting has one name and one place: a field of a section below. Its command-line flag is generated
from the field (megazero.config.cli); Megatron-LM's spellings are the field names, or aliases listed
in megazero.config.cli.FLAG_ALIASES. Fields that set an engine key (Megatron's `--lr`,
`--micro-batch-size`, `--bf16`, ...) name that key in ENGINE_KEYS: given, the flag wins over the
engine JSON and `RunConfig.resolve` records which key it set and what the JSON held, which the
printed config shows.

    run = RunConfig.resolve(tree)     # engine keys written, checked once
    run.engine_config()               # the validated megazero.config.EngineConfig
    run.to_dict()                     # the resolved tree: printed, saved beside TensorBoard and in
                                      # every checkpoint; `--config that.json` runs it again
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import warnings
from collections.abc import Callable
from typing import Annotated, Any, Literal

import tyro
from pydantic import BaseModel, ConfigDict, Field

from megazero.config import ConfigError, resolve_batch_triad, validate_config


class RunSection(BaseModel):
    """A section of the run tree: unknown keys are errors, values are checked when set, NaN and +-inf
    are refused."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)


class ParallelSection(RunSection):
    """How the ranks split the model (checked once against the world size by `data_parallel_size`)."""

    tensor_model_parallel_size: int = Field(1, ge=1, description="ranks each layer's matrices are split over")
    pipeline_model_parallel_size: int = Field(1, ge=1, description="pipeline stages")
    num_layers_per_virtual_pipeline_stage: int | None = Field(
        None, ge=1, description="interleaved 1F1B: each stage holds num_layers / (PP x this) model chunks "
                                "(engine key pipeline.num_layers_per_virtual_stage)")
    pipeline_schedule: Literal["1f1b", "interleaved", "zb-h1", "zbv"] | None = Field(
        None, description="1f1b (interleaved with virtual stages), interleaved (needs "
                          "--num-layers-per-virtual-pipeline-stage), zb-h1 (zero-bubble: backward split into "
                          "input and weight gradients) or zbv (zero-bubble V: two model chunks per stage, at "
                          "least 2 x PP micro-batches) (engine key pipeline.schedule; default 1f1b)")
    pipeline_partition_method: Literal["parameters", "compute", "measured"] | None = Field(
        None, description="which layers each stage holds: balanced by parameters, forward FLOPs or measured time "
                          "(engine key pipeline.partition_method; default parameters)")
    expert_model_parallel_size: int = Field(1, ge=1, description="ranks the experts are split over; divides DP")
    sequence_parallel: bool = Field(False, description="split LayerNorm/dropout activations along the sequence "
                                                       "across tensor-parallel ranks")
    context_parallel_size: int = Field(1, ge=1, description="ranks each sample's sequence is split over")
    cp_comm_type: Literal["p2p", "a2a"] = Field("p2p", description="context parallelism's attention: p2p (ring "
                                                                   "attention) or a2a (all-to-all, Ulysses)")

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size at `world_size` ranks (the ways the batch is split: context-parallel
        ranks share samples); an error naming the flags where they do not divide."""
        model_parallel = (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                          * self.context_parallel_size)
        if world_size % model_parallel:
            raise ConfigError(f"--tensor-model-parallel-size {self.tensor_model_parallel_size} x "
                              f"--pipeline-model-parallel-size {self.pipeline_model_parallel_size} x "
                              f"--context-parallel-size {self.context_parallel_size} = {model_parallel} "
                              f"does not divide the world size {world_size}")
        dp = world_size // model_parallel
        if (dp * self.context_parallel_size) % self.expert_model_parallel_size:  # EP splits DP x CP
            raise ConfigError(f"--expert-model-parallel-size {self.expert_model_parallel_size} does not divide the "
                              f"data-parallel size {dp * self.context_parallel_size} (world {world_size} / TP x PP "
                              f"{model_parallel // self.context_parallel_size})")
        return dp


class TrainingSection(RunSection):
    """Megatron's batch, optimizer, precision and learning-rate flags. Each sets the engine key it
    names (the flag wins over the engine JSON); unset, the JSON's value stands. Any of the lr-*
    flags (and --min-lr) makes the schedule Megatron's (scheduler type MegatronLR) from these flags
    with Megatron's defaults."""

    micro_batch_size: int | None = Field(None, ge=1, description="engine key train_micro_batch_size_per_gpu")
    global_batch_size: int | None = Field(None, ge=1, description="engine key train_batch_size")
    optimizer: Literal["adam", "sgd", "muon"] | None = Field(
        None, description="engine key optimizer.type: adam is AdamW (Megatron's adam decays decoupled), muon is Muon "
                          "on the hidden matrices with AdamW on the rest (an Adam block's lr, weight decay, betas and "
                          "eps become its AdamW part's; --lr and --weight-decay set Muon's)")
    lr: float | None = Field(None, ge=0, description="peak learning rate: engine key optimizer.params.lr")
    weight_decay: float | None = Field(None, ge=0, description="engine key optimizer.params.weight_decay")
    adam_beta1: float | None = Field(None, ge=0, lt=1,
                                     description="engine key optimizer.params.betas[0] (Muon: adamw_betas)")
    adam_beta2: float | None = Field(None, ge=0, lt=1,
                                     description="engine key optimizer.params.betas[1] (Muon: adamw_betas)")
    adam_eps: float | None = Field(None, gt=0, description="engine key optimizer.params.eps (Muon: adamw_eps)")
    muon_momentum: float | None = Field(None, ge=0, lt=1, description="engine key optimizer.params.momentum (Muon)")
    muon_nesterov: bool | None = Field(None, description="engine key optimizer.params.nesterov (Muon; False: plain "
                                                         "momentum)")
    muon_num_ns_steps: int | None = Field(None, ge=1, description="engine key optimizer.params.ns_steps (Muon)")
    muon_scale_mode: Literal["shape", "spectral"] | None = Field(
        None, description="engine key optimizer.params.scale_mode (Muon)")
    muon_extra_scale_factor: float | None = Field(None, gt=0, description="engine key optimizer.params."
                                                                          "extra_scale_factor (Muon)")
    clip_grad: float | None = Field(None, ge=0, description="gradient norm clipping: engine key gradient_clipping")
    bf16: bool = Field(False, description="bfloat16 compute: engine key bf16.enabled")
    fp16: bool = Field(False, description="float16 compute with a loss scale: engine key fp16.enabled")
    use_distributed_optimizer: bool = Field(
        False, description="shard the optimizer state over data-parallel ranks: ZeRO stage 1 where the engine "
                           "config has stage 0 (engine key zero_optimization.stage)")
    overlap_grad_reduce: bool = Field(False, description="reduce gradients while backward runs: engine key "
                                                         "zero_optimization.overlap_comm")
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] | None = Field(
        None, description="Megatron's decay after warm-up (default linear)")
    min_lr: float | None = Field(None, ge=0, description="the LR the decay ends at (default 0)")
    lr_warmup_fraction: float | None = Field(None, ge=0, le=1, description="warm-up as a fraction of the decay "
                                                                           "iterations")
    lr_warmup_iters: int | None = Field(None, ge=0, description="warm-up iterations (default 0)")
    lr_warmup_init: float | None = Field(None, ge=0, description="the LR warm-up starts from (default 0)")
    lr_decay_iters: int | None = Field(None, ge=1, description="iterations the decay spans (default --train-iters)")

    def check(self) -> None:
        """The flags that exclude each other (checked once the flags are in, by RunConfig.resolve)."""
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 are both set: choose one")
        if self.lr_warmup_fraction is not None and self.lr_warmup_iters is not None:
            raise ValueError("--lr-warmup-fraction and --lr-warmup-iters are both set: give one")

    def megatron_schedule(self, train_iters: int, global_batch_size: int) -> dict | None:
        """The engine `scheduler` block of Megatron's LR flags (None where none is given): counted in
        samples, as Megatron counts them, so a batch ramp-up slows the schedule as it does there."""
        flags = ("lr_decay_style", "min_lr", "lr_warmup_fraction", "lr_warmup_iters", "lr_warmup_init",
                 "lr_decay_iters")
        if all(getattr(self, name) is None for name in flags):
            return None
        decay_iters = self.lr_decay_iters or train_iters
        warmup_iters = (self.lr_warmup_fraction * decay_iters if self.lr_warmup_fraction is not None
                        else self.lr_warmup_iters or 0)
        return {"type": "MegatronLR", "params": {
            "decay_style": self.lr_decay_style or "linear", "min_lr": self.min_lr or 0.0,
            "warmup_init_lr": self.lr_warmup_init or 0.0,
            "warmup_num_samples": int(warmup_iters * global_batch_size),
            "decay_num_samples": decay_iters * global_batch_size, "samples_per_step": global_batch_size}}


class ScheduleSection(RunSection):
    """How long the run trains and how often it evaluates, saves and logs."""

    train_iters: int = Field(500, ge=0, description="optimizer steps of the whole run")
    exit_duration_in_mins: float | None = Field(None, gt=0, description="stop (saving a checkpoint) after this "
                                                                        "much training time in this run")
    rampup_batch_size: list[int] | None = Field(
        None, description="START INCREMENT SAMPLES: the global batch grows from START by INCREMENT until SAMPLES "
                          "samples are consumed, then is --global-batch-size")
    eval_interval: int = Field(100, ge=1, description="validate every this many iterations")
    eval_iters: int = Field(20, ge=1, description="validation micro-batches per data-parallel rank")
    save_interval: int = Field(100, ge=1, description="save a checkpoint every this many iterations (with --save)")
    log_interval: int = Field(10, ge=1, description="print and log every this many iterations")

    def check(self) -> None:
        """--rampup-batch-size's three numbers (checked by RunConfig.resolve)."""
        if self.rampup_batch_size is not None and (len(self.rampup_batch_size) != 3
                                                   or min(self.rampup_batch_size) < 1):
            raise ValueError(f"--rampup-batch-size takes three positive numbers START INCREMENT SAMPLES, got "
                             f"{self.rampup_batch_size}")


class DataSection(RunSection):
    """The datasets and the tokenizer."""

    data_path: list[str] | None = Field(
        None, description="prefix P of P_train_text_document and P_valid_text_document (.bin/.idx), or of one "
                          "dataset cut by --split; or weight-prefix pairs W1 P1 W2 P2 ... to blend")
    split: str = Field("969,30,1", description="train,valid,test weights cutting a one-dataset --data-path by "
                                               "documents")
    train_data_path: list[str] | None = Field(None, description="the train datasets: one prefix or weight-prefix "
                                                                "pairs, instead of --data-path")
    valid_data_path: list[str] | None = Field(None, description="the validation datasets (each reported apart)")
    test_data_path: list[str] | None = Field(None, description="the test datasets (each reported apart)")
    tokenizer_type: str | None = Field(
        None, description="GPTSentencePieceTokenizer (sentencepiece), HuggingFaceTokenizer (hf), TikTokenizer "
                          "(tiktoken) or GPT2BPETokenizer (gpt2bpe) (default: gpt2bpe with --vocab-file, else the one "
                          "the first prefix's P_stats.json names, else sentencepiece)")
    tokenizer_model: str | None = Field(
        None, description="sentencepiece .model, Hugging Face tokenizer directory or tokenizer.json, or .tiktoken "
                          "file (default: P_tokenizer.model of the first prefix, or the one P_stats.json names)")
    vocab_file: str | None = Field(None, description="GPT2BPETokenizer: GPT-2's vocab.json")
    merge_file: str | None = Field(None, description="GPT2BPETokenizer: GPT-2's merges.txt")
    reset_position_ids: bool = Field(False, description="GPT/Llama: positions restart after each end-of-document "
                                                        "token of a sample")
    reset_attention_mask: bool = Field(False, description="GPT/Llama: a token attends to the earlier tokens of its "
                                                          "own document only (per-document causal attention)")
    eod_mask_loss: bool = Field(False, description="GPT/Llama: no loss where the input token is the end-of-document "
                                                   "token (the prediction across a document boundary)")

    def checked(self) -> DataSection:
        """This section with the data paths checked (one of --data-path or --train-data-path, each a
        prefix or weight-prefix pairs) and the tokenizer's defaults filled in."""
        from megazero.data.blended_dataset import parse_data_path
        from megazero.data.data_paths import default_tokenizer, first_prefix
        from megazero.data.tokenizer import resolve_spec

        if bool(self.data_path) == bool(self.train_data_path):
            raise ValueError("give one of --data-path (with --split) or --train-data-path (with --valid-data-path)")
        for split in ("", "train", "valid", "test"):
            values = getattr(self, f"{split}_data_path" if split else "data_path")
            if values:
                parse_data_path(values, f"--{split}-data-path" if split else "--data-path",
                                unweighted=split in ("valid", "test"))
        spec = resolve_spec(self.tokenizer_type, self.tokenizer_model, self.vocab_file, self.merge_file,
                            lambda: default_tokenizer(first_prefix(self))).absolute()
        return self.model_copy(update={"tokenizer_type": spec.type, "tokenizer_model": spec.model,
                                       "vocab_file": spec.vocab_file, "merge_file": spec.merge_file})

    def document_packing(self, eod: int):
        """The megazero.data.packing.DocumentPacking of the three document flags, ending documents at `eod`."""
        from megazero.data.packing import DocumentPacking

        return DocumentPacking(eod, self.reset_position_ids, self.reset_attention_mask, self.eod_mask_loss)

    def tokenizer_spec(self):
        """The run's megazero.data.TokenizerSpec (of a checked section)."""
        from megazero.data.tokenizer import TokenizerSpec

        return TokenizerSpec(self.tokenizer_type, self.tokenizer_model, self.vocab_file, self.merge_file)


class CheckpointSection(RunSection):
    """Where checkpoints are written and read."""

    save: str | None = Field(None, description="directory to save checkpoints in")
    load: str | None = Field(None, description="directory to resume from (nothing there yet: start from scratch)")
    load_fallback: bool = Field(False, description="if --load's `latest` is corrupt, load the previous complete tag")
    continue_on_save_failure: bool = Field(False, description="a failed save warns and training goes on "
                                                              "(default: stop)")


class LoggingSection(RunSection):
    """TensorBoard, wandb, the MFU peak and the watchdog."""

    tensorboard_dir: str | None = Field(None, description="TensorBoard event directory (engine key "
                                                           "tensorboard.output_path)")
    wandb: bool = Field(False, description="log to wandb, offline unless WANDB_API_KEY is set (engine key "
                                           "wandb.enabled)")
    wandb_project: str | None = Field(None, description="wandb project (engine key wandb.project; implies --wandb)")
    peak_flops: float | None = Field(None, gt=0, description="per-rank peak FLOP/s for MFU (default: measured)")
    watchdog_timeout: float | None = Field(
        None, ge=0, description="seconds a collective may wait for a missing rank before it is named and the job "
                                "exits (0: off; engine key watchdog.timeout)")


class SampleSection(RunSection):
    """The text a causal LM recipe samples at the end of its run."""

    sample_prompt: str = Field("ROMEO:\n", description="prompt of the end-of-run sample")
    sample_tokens: int = Field(120, ge=0, description="tokens sampled at the end of the run")


def _set(config: dict, path: str, value: Any) -> None:
    """config[a][b][c] = value for path "a.b.c" (an integer part indexes a list)."""
    *parents, last = path.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    if last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value


def _get(config: dict, path: str) -> Any:
    node: Any = config
    for part in path.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def _is_muon(config: dict) -> bool:
    return str(config.get("optimizer", {}).get("type", "")).lower() == "muon"


def _betas(index: int) -> Callable[[dict, float], str]:
    def write(config: dict, value: float) -> str:
        params = config.setdefault("optimizer", {"type": "AdamW", "params": {}}).setdefault("params", {})
        key = "adamw_betas" if _is_muon(config) else "betas"  # Muon's AdamW part
        betas = list(params.get(key, [0.9, 0.95] if _is_muon(config) else [0.9, 0.999]))
        betas[index] = value
        params[key] = betas
        return f"optimizer.params.{key}.{index}"
    return write


def _adam_eps(config: dict, value: float) -> str:
    key = "adamw_eps" if _is_muon(config) else "eps"
    config.setdefault("optimizer", {"type": "AdamW", "params": {}}).setdefault("params", {})[key] = value
    return f"optimizer.params.{key}"


# Megatron's --optimizer to the engine's type; Adam's keys that Muon names for its AdamW part
OPTIMIZER_TYPES = {"adam": "AdamW", "sgd": "SGD", "muon": "Muon"}
MUON_ADAMW_KEYS = {"lr": "adamw_lr", "weight_decay": "adamw_weight_decay", "betas": "adamw_betas",
                   "eps": "adamw_eps"}
ADAM_ONLY_KEYS = ("torch_adam", "amsgrad", "bias_correction", "adam_w_mode")


def _optimizer(config: dict, name: str) -> str:
    """optimizer.type from --optimizer. Switching an Adam block to Muon makes the block's keys its
    AdamW part's (lr, weight_decay, betas, eps: the rest of the model keeps the training it was
    tuned for), leaves Muon's own at its defaults (--lr and --weight-decay set them) and drops the
    keys only Adam has."""
    block = config.setdefault("optimizer", {"type": "AdamW", "params": {}})
    before = str(block.get("type", "")).lower()
    block["type"] = OPTIMIZER_TYPES[name]
    params = block.setdefault("params", {})
    if name == "muon" and before != "muon":
        for adam_key, muon_key in MUON_ADAMW_KEYS.items():
            if adam_key in params:
                params[muon_key] = params.pop(adam_key)
        for key in ADAM_ONLY_KEYS:
            params.pop(key, None)
    return "optimizer.type"


def _muon_key(key: str) -> Callable[[dict, Any], str]:
    """A --muon-* flag's writer: optimizer.params.<key>, for a Muon block only (an error otherwise)."""
    def write(config: dict, value: Any) -> str:
        if not _is_muon(config):
            raise ConfigError(f"--muon-{key.replace('_', '-')} sets a Muon option, but the optimizer is "
                              f"{config.get('optimizer', {}).get('type', 'AdamW')}: add --optimizer muon (or give an "
                              f"engine JSON whose optimizer.type is Muon)")
        _set(config, f"optimizer.params.{key}", value)
        return f"optimizer.params.{key}"
    return write


def _precision(key: str, other: str) -> Callable[[dict, bool], str]:
    def write(config: dict, on: bool) -> str:
        config.pop("bfloat16", None)  # the flag decides; DeepSpeed's older spelling must not contradict it
        config.pop(other, None)
        config[key] = {**config.get(key, {}), "enabled": True}
        return f"{key}.enabled"
    return write


def _distributed_optimizer(config: dict, on: bool) -> str:
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = max(1, zero.get("stage", 0))
    return "zero_optimization.stage"


def _tensorboard(config: dict, path: str) -> str:
    config["tensorboard"] = {"enabled": True, "output_path": path, "job_name": ""}
    return "tensorboard.output_path"


def _wandb_project(config: dict, project: str) -> str:
    config["wandb"] = {**config.get("wandb", {}), "enabled": True, "project": project}
    return "wandb.project"


def _watchdog(config: dict, seconds: float) -> str:
    config["watchdog"] = {"enabled": seconds > 0, "timeout": seconds or 60.0}
    return "watchdog.timeout"


# (section, field) -> the engine key it sets, or a writer(config, value) returning the key it set.
# A bool flag sets its key only when given (True); a None field leaves the JSON's value.
ENGINE_KEYS: dict[tuple[str, str], str | Callable[[dict, Any], str]] = {
    ("parallel", "num_layers_per_virtual_pipeline_stage"): "pipeline.num_layers_per_virtual_stage",
    ("parallel", "pipeline_partition_method"): "pipeline.partition_method",
    ("parallel", "pipeline_schedule"): "pipeline.schedule",
    ("training", "micro_batch_size"): "train_micro_batch_size_per_gpu",
    ("training", "global_batch_size"): "train_batch_size",
    ("training", "optimizer"): _optimizer,  # first: the keys below depend on the type
    ("training", "lr"): "optimizer.params.lr",
    ("training", "weight_decay"): "optimizer.params.weight_decay",
    ("training", "adam_beta1"): _betas(0),
    ("training", "adam_beta2"): _betas(1),
    ("training", "adam_eps"): _adam_eps,
    ("training", "muon_momentum"): _muon_key("momentum"),
    ("training", "muon_nesterov"): _muon_key("nesterov"),
    ("training", "muon_num_ns_steps"): _muon_key("ns_steps"),
    ("training", "muon_scale_mode"): _muon_key("scale_mode"),
    ("training", "muon_extra_scale_factor"): _muon_key("extra_scale_factor"),
    ("training", "clip_grad"): "gradient_clipping",
    ("training", "bf16"): _precision("bf16", "fp16"),
    ("training", "fp16"): _precision("fp16", "bf16"),
    ("training", "use_distributed_optimizer"): _distributed_optimizer,
    ("training", "overlap_grad_reduce"): "zero_optimization.overlap_comm",
    ("logging", "tensorboard_dir"): _tensorboard,
    ("logging", "wandb"): "wandb.enabled",
    ("logging", "wandb_project"): _wandb_project,
    ("logging", "watchdog_timeout"): _watchdog,
}


@dataclasses.dataclass
class EngineKeyNote:
    """One engine key a flag set: its value, the flag, and what the engine JSON held (None: absent)."""

    key: str
    value: Any
    flag: str
    json_value: Any

    def __str__(self) -> str:
        held = "absent" if self.json_value is None else json.dumps(self.json_value)
        return f"{self.key} = {json.dumps(self.value)} from {self.flag} (the engine JSON's: {held})"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class RunConfig(RunSection):
    """The whole run. A recipe subclasses it to give `model` its model section type (and adds the
    sections only it has, e.g. `sample`); `engine` is the engine JSON as a dict, validated as
    megazero.config.EngineConfig by `engine_config()`."""

    config: str | None = Field(None, description="a run config JSON (e.g. a run's saved run_config.json) instead of "
                                                 "the recipe's run file: the defaults every other flag changes")
    model_config_file: Annotated[str | None, tyro.conf.arg(name="model-config")] = Field(
        None, description="model JSON: the model section's values, instead of the run file's")
    deepspeed_config: str | None = Field(None, description="engine JSON, DeepSpeed-compatible, instead of the run "
                                                           "file's")
    deepspeed: bool = Field(False, description="accepted for DeepSpeed compatibility; the engine is always used")
    seed: int = Field(1234, description="seed of the model's initialisation, dropout and data order")
    attention_backend: str = Field(
        "auto", description="Megatron's attention kernel choice: only auto, since the models call torch's "
                            "scaled_dot_product_attention, which picks flash, memory-efficient or math kernels itself")
    model: Annotated[Any, tyro.conf.Suppress] = None  # a recipe's subclass gives its model section
    parallel: ParallelSection = ParallelSection()
    training: TrainingSection = TrainingSection()
    schedule: ScheduleSection = ScheduleSection()
    data: DataSection = DataSection()
    checkpoint: CheckpointSection = CheckpointSection()
    logging: LoggingSection = LoggingSection()
    engine: Annotated[dict, tyro.conf.Suppress] = Field(default_factory=dict)
    engine_notes: Annotated[list[str], tyro.conf.Suppress] = Field(default_factory=list)

    def check(self) -> None:
        """What one field alone cannot say: checked once the flags are in, by resolve()."""
        self.training.check()
        self.schedule.check()
        if self.attention_backend != "auto":
            raise ValueError(f"--attention-backend {self.attention_backend}: not honoured here: the models call "
                             f"torch's scaled_dot_product_attention, which picks its kernel itself (give auto)")
    engine_file: Annotated[str, tyro.conf.Suppress] = ""  # where `engine` came from, for error messages

    def resolve(self) -> RunConfig:
        """The run with every given engine-key flag written into `engine` (each key it changes noted
        in engine_notes), and the schedule keys that follow --train-iters and --lr. The flags keep
        their values in their sections: the saved tree says what was given, and given again (a
        rerun from it) they change nothing."""
        self.check()
        engine = copy.deepcopy(self.engine)
        notes = list(self.engine_notes)
        sections = {name: getattr(self, name).model_copy() for name in
                    ("parallel", "training", "schedule", "checkpoint", "logging")}
        sections["data"] = self.data.checked()
        for (section, name), target in ENGINE_KEYS.items():
            value = getattr(sections[section], name)
            # a store-true flag (default False) sets its key only when given; an optional bool's False is a value
            if value is None or (value is False and type(sections[section]).model_fields[name].default is False):
                continue
            before = copy.deepcopy(engine)
            key = target(engine, value) if callable(target) else target
            if not callable(target):
                _set(engine, target, value)
            if _get(engine, key) != _get(before, key):
                notes.append(str(EngineKeyNote(key, _get(engine, key), _flag(name), _get(before, key))))
        megatron = self.training.megatron_schedule(self.schedule.train_iters, _global_batch(engine))
        if megatron is None:
            notes += _follow_schedule(engine, self.schedule.train_iters, self.training.lr)
        elif engine.get("scheduler") != megatron:
            replaced = engine.get("scheduler", {}).get("type")
            engine["scheduler"] = megatron
            notes.append(f"scheduler = MegatronLR from the --lr-* flags (the engine JSON's: {replaced or 'absent'})")
        return self.model_copy(update={**sections, "engine": engine, "engine_notes": notes})

    def engine_config(self):
        """The validated engine config (megazero.config.EngineConfig)."""
        return validate_config(copy.deepcopy(self.engine))

    def to_dict(self) -> dict:
        """The tree as plain JSON values (the file `--config` reads back)."""
        out = self.model_dump(mode="json", exclude={"config", "model_config_file", "deepspeed_config",
                                                    "deepspeed", "model", "engine_notes", "engine_file"})
        out["model"] = dataclasses.asdict(self.model) if dataclasses.is_dataclass(self.model) else self.model
        return out


def _global_batch(engine: dict) -> int:
    """The engine config's train_batch_size (from the triad where it is not given; 1 where unknown)."""
    try:
        return resolve_batch_triad(engine.get("train_batch_size"), engine.get("train_micro_batch_size_per_gpu"),
                                   engine.get("gradient_accumulation_steps"), 1)[0] \
            if engine.get("train_batch_size") is None else engine["train_batch_size"]
    except ConfigError:
        return 1


def _follow_schedule(engine: dict, train_iters: int, lr: float | None) -> list[str]:
    """DeepSpeed's decaying schedules end at --train-iters, and its WarmupLR/WarmupDecayLR warm up to
    --lr where given (their own warmup_max_lr otherwise): notes for the keys set."""
    scheduler = engine.get("scheduler")
    if not isinstance(scheduler, dict):
        return []
    params = scheduler.setdefault("params", {})
    notes = []
    if scheduler.get("type") in ("WarmupDecayLR", "WarmupCosineLR") and params.get("total_num_steps") != train_iters:
        notes.append(str(EngineKeyNote("scheduler.params.total_num_steps", train_iters, "--train-iters",
                                       params.get("total_num_steps"))))
        params["total_num_steps"] = train_iters
        warmup = params.get("warmup_num_steps", 0)
        if isinstance(warmup, int) and warmup >= train_iters:
            warnings.warn(f"scheduler.params.warmup_num_steps {warmup} (the engine JSON's) >= --train-iters "
                          f"{train_iters}: the learning rate never leaves its warm-up; lower warmup_num_steps, "
                          f"or give Megatron's --lr-warmup-iters with --lr-decay-style", stacklevel=3)
    if lr is not None and scheduler.get("type") in ("WarmupLR", "WarmupDecayLR"):
        notes.append(str(EngineKeyNote("scheduler.params.warmup_max_lr", lr, "--lr", params.get("warmup_max_lr"))))
        params["warmup_max_lr"] = lr
    return notes


class BatchRampup:
    """Megatron's --rampup-batch-size START INCREMENT SAMPLES: the global batch is START, grows by
    INCREMENT each SAMPLES / ((GLOBAL - START) / INCREMENT) consumed samples, and is GLOBAL once SAMPLES
    are consumed; each size a multiple of micro-batch x data-parallel size."""

    def __init__(self, start: int, increment: int, samples: int, global_batch_size: int, micro_times_dp: int):
        if start > global_batch_size or (global_batch_size - start) % increment:
            raise ConfigError(f"--rampup-batch-size {start} {increment} {samples}: the global batch size "
                              f"{global_batch_size} minus START must be a non-negative multiple of INCREMENT")
        for size in (start, increment):
            if size % micro_times_dp:
                raise ConfigError(f"--rampup-batch-size {start} {increment} {samples}: {size} is not a multiple of "
                                  f"micro-batch x data-parallel size {micro_times_dp}")
        self.start, self.increment, self.samples, self.final = start, increment, samples, global_batch_size
        increments = (global_batch_size - start) // increment
        self.samples_per_increment = samples / increments if increments else math.inf

    def batch_size(self, consumed_samples: int) -> int:
        """The global batch of the step that starts at `consumed_samples`."""
        if consumed_samples > self.samples:
            return self.final
        return min(self.final, self.start + int(consumed_samples / self.samples_per_increment) * self.increment)
