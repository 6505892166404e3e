"""The engine configuration: a DeepSpeed-compatible JSON file or dict, validated into typed objects.

Every accepted key has DeepSpeed's meaning and default. Unknown keys, wrong types and
out-of-range values raise :class:`ConfigError` naming the key (with the nearest valid key as a
suggestion); nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration key is unknown, has the wrong type, or holds an invalid value."""


def _suggest(key: str, valid: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def check_known_keys(given: dict, valid: typing.Iterable[str], where: str) -> None:
    """Raise ConfigError for the first key of `given` that is not in `valid`."""
    valid = list(valid)
    for key in given:
        if key not in valid:
            raise ConfigError(
                f"unknown key '{where}{key}'{_suggest(key, valid)}; valid keys: {', '.join(sorted(valid))}"
            )


def _check_type(value: Any, annotation: Any, name: str) -> Any:
    """Check `value` against a simple annotation (bool, int, float, str, dict, list, Optional)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(value, inner[0], name)
    expected = origin or annotation
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is int and isinstance(value, float) and value.is_integer():
        return int(value)  # JSON writers like 5e8
    if expected in (int, float) and isinstance(value, bool):
        raise ConfigError(f"'{name}' must be {expected.__name__}, got bool {value!r}")
    if not isinstance(value, expected):
        raise ConfigError(f"'{name}' must be {expected.__name__}, got {type(value).__name__} {value!r}")
    return value


def _from_dict(cls: type, given: Any, where: str):
    """Build dataclass `cls` from `given`, checking key names and value types."""
    if given is None:
        return cls()
    if not isinstance(given, dict):
        raise ConfigError(f"'{where.rstrip('.')}' must be an object, got {type(given).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    check_known_keys(given, fields, where)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in given.items():
        kwargs[key] = _check_type(value, hints[key], where + key)
    obj = cls(**kwargs)
    obj.validate(where)
    return obj


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass
class FP16Config:
    """`fp16`: half precision with a (dynamic by default) loss scale."""

    enabled: bool = False
    loss_scale: float = 0.0  # 0 means dynamic loss scaling
    initial_scale_power: int = 16  # dynamic scaling starts at 2**initial_scale_power
    loss_scale_window: int = 1000  # clean steps before the scale doubles
    hysteresis: int = 2  # overflows tolerated before the scale halves
    consecutive_hysteresis: bool = False  # refill hysteresis after every clean step
    min_loss_scale: float = 1.0

    def validate(self, where: str) -> None:
        _require(self.loss_scale >= 0, f"'{where}loss_scale' must be >= 0 (0 = dynamic), got {self.loss_scale}")
        _require(0 <= self.initial_scale_power <= 64,
                 f"'{where}initial_scale_power' must be in [0, 64], got {self.initial_scale_power}")
        _require(self.loss_scale_window >= 1,
                 f"'{where}loss_scale_window' must be >= 1, got {self.loss_scale_window}")
        _require(self.hysteresis >= 1, f"'{where}hysteresis' must be >= 1, got {self.hysteresis}")
        _require(self.min_loss_scale > 0, f"'{where}min_loss_scale' must be > 0, got {self.min_loss_scale}")


@dataclass
class BF16Config:
    """`bf16`: bfloat16 compute with fp32 master weights and fp32 gradient accumulation."""

    enabled: bool = False

    def validate(self, where: str) -> None:
        pass


@dataclass
class ZeroConfig:
    """`zero_optimization`: stage 0 is plain data parallelism with bucketed all-reduce; stage 1
    partitions the fp32 master weights and optimizer states; stage 2 the gradients too."""

    stage: int = 0
    reduce_bucket_size: int = 500_000_000  # elements per gradient bucket
    overlap_comm: bool = True  # start a bucket's reduction during backward, as soon as it fills
    stage3_param_persistence_threshold: int = 100_000  # stage 3: smaller units stay whole
    stage3_prefetch_bucket_size: int = 50_000_000  # stage 3: prefetch the next layer up to this size (0: off)
    contiguous_gradients: bool = True  # gradient partitions are always one contiguous buffer here
    reduce_scatter: bool = True  # stages 2-3 always reduce-scatter (never all-reduce) the gradients
    stage3_gather_16bit_weights_on_model_save: bool = False  # save_16bit_model() gathers stage 3's weights

    def validate(self, where: str) -> None:
        _require(self.stage in (0, 1, 2, 3), f"'{where}stage' must be 0, 1, 2 or 3, got {self.stage}")
        _require(self.stage3_param_persistence_threshold >= 0,
                 f"'{where}stage3_param_persistence_threshold' must be >= 0")
        _require(self.stage3_prefetch_bucket_size >= 0, f"'{where}stage3_prefetch_bucket_size' must be >= 0")
        _require(self.contiguous_gradients, f"'{where}contiguous_gradients' false is not supported: megazero "
                                            f"always keeps gradients in contiguous buffers")
        _require(self.reduce_scatter, f"'{where}reduce_scatter' false is not supported: gradients are always "
                                      f"reduce-scattered")
        _require(self.reduce_bucket_size >= 1,
                 f"'{where}reduce_bucket_size' must be >= 1, got {self.reduce_bucket_size}")


@dataclass
class TensorBoardConfig:
    """`tensorboard`: scalars written by rank 0 to output_path/job_name."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "megazero"

    def validate(self, where: str) -> None:
        pass


@dataclass
class WandbConfig:
    """`wandb`: offline unless WANDB_API_KEY is set (or WANDB_MODE says otherwise)."""

    enabled: bool = False
    team: str | None = None
    group: str | None = None
    project: str = "megazero"

    def validate(self, where: str) -> None:
        pass


@dataclass
class FlopsProfilerConfig:
    """`flops_profiler`: profile the forward of one step (DeepSpeed's keys)."""

    enabled: bool = False
    profile_step: int = 1  # the optimizer step (1-based) whose first forward is profiled
    module_depth: int = -1  # -1: every depth
    top_modules: int = 1
    detailed: bool = True
    output_file: str | None = None  # default: print on rank 0

    def validate(self, where: str) -> None:
        _require(self.profile_step >= 1, f"'{where}profile_step' must be >= 1, got {self.profile_step}")
        _require(self.top_modules >= 1, f"'{where}top_modules' must be >= 1, got {self.top_modules}")


@dataclass
class ActivationCheckpointingConfig:
    """`activation_checkpointing`: options of megazero.activation_checkpointing.configure (DeepSpeed's keys)."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    def validate(self, where: str) -> None:
        _require(not self.contiguous_memory_optimization or self.partition_activations,
                 f"'{where}contiguous_memory_optimization' needs '{where}partition_activations' (as in DeepSpeed)")
        _require(not self.contiguous_memory_optimization or bool(self.number_checkpoints),
                 f"'{where}contiguous_memory_optimization' needs '{where}number_checkpoints' (buffer slots)")


TAG_VALIDATION_MODES = ("WARN", "IGNORE", "FAIL")


@dataclass
class CheckpointConfig:
    """`checkpoint`: how save_checkpoint() treats tags that differ across ranks (DeepSpeed's keys).
    Every rank uses rank 0's tag; Warn (default) names the ranks that differ, Fail raises, Ignore is silent."""

    tag_validation: str = "WARN"  # Warn | Ignore | Fail, any case (stored upper-case)

    def validate(self, where: str) -> None:
        _require(self.tag_validation.upper() in TAG_VALIDATION_MODES,
                 f"'{where}tag_validation' must be one of Warn, Ignore, Fail (any case), got {self.tag_validation!r}")
        self.tag_validation = self.tag_validation.upper()


OPTIMIZER_PARAMS: dict[str, set[str]] = {
    "adam": {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "amsgrad", "bias_correction"},
    "adamw": {"lr", "betas", "eps", "weight_decay", "torch_adam", "amsgrad", "bias_correction"},
    "sgd": {"lr", "momentum", "dampening", "weight_decay", "nesterov"},
    "lamb": {"lr", "betas", "eps", "weight_decay", "bias_correction", "max_coeff", "min_coeff", "torch_adam"},
    "adagrad": {"lr", "lr_decay", "eps", "weight_decay", "initial_accumulator_value", "torch_adam"},
}


@dataclass
class OptimizerConfig:
    """`optimizer`: {"type": Adam | AdamW | SGD | Lamb | Adagrad, "params": {...}} (type is case-insensitive)."""

    type: str = "AdamW"
    params: dict = field(default_factory=dict)

    def validate(self, where: str) -> None:
        kind = self.type.lower()
        _require(kind in OPTIMIZER_PARAMS,
                 f"'{where}type' {self.type!r} is not supported{_suggest(kind, OPTIMIZER_PARAMS)}; "
                 f"choose one of Adam, AdamW, SGD, Lamb, Adagrad")
        check_known_keys(self.params, OPTIMIZER_PARAMS[kind], f"{where}params.")
        if "lr" in self.params:
            _check_type(self.params["lr"], float, f"{where}params.lr")
            _require(self.params["lr"] >= 0, f"'{where}params.lr' must be >= 0, got {self.params['lr']}")


@dataclass
class SchedulerConfig:
    """`scheduler`: {"type": one of megazero.optim.lr_schedules.SCHEDULERS, "params": {...}}."""

    type: str = "WarmupLR"
    params: dict = field(default_factory=dict)

    def validate(self, where: str) -> None:
        from megazero.optim.lr_schedules import SCHEDULERS

        _require(self.type in SCHEDULERS,
                 f"'{where}type' {self.type!r} is not a known scheduler{_suggest(self.type, SCHEDULERS)}; "
                 f"choose one of {', '.join(SCHEDULERS)}")
        signature = inspect.signature(SCHEDULERS[self.type].__init__)
        accepted = [p for p in signature.parameters if p not in ("self", "optimizer", "last_batch_iteration")]
        check_known_keys(self.params, accepted, f"{where}params.")


@dataclass
class EngineConfig:
    """The whole engine configuration, with the batch-size triad resolved for a data-parallel size."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    data_parallel_size: int
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    gradient_clipping: float = 0.0
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig)
    activation_checkpointing: ActivationCheckpointingConfig | None = None
    seed: int | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # megazero's own key (DeepSpeed has none): after this many consecutive skipped optimizer steps
    # (fp16 overflows, inf/nan gradients or forward losses in any precision) the run stops with
    # megazero.numerics.NumericsError; 0 = never. 100 is longer than any loss-scale search a
    # healthy fp16 run makes (from 2**64, the largest initial_scale_power, to a scale of 1 is 65
    # skips with the default hysteresis 2), yet stops a diverged run instead of skipping forever
    max_consecutive_skipped_steps: int = 100

    @property
    def compute_dtype(self):
        """The dtype the model computes in: float16, bfloat16 or float32."""
        import torch

        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32


_TOP_LEVEL_SCALARS = {
    "train_batch_size": int | None,
    "train_micro_batch_size_per_gpu": int | None,
    "gradient_accumulation_steps": int | None,
    "gradient_clipping": float,
    "steps_per_print": int,
    "wall_clock_breakdown": bool,
    "seed": int | None,
    "max_consecutive_skipped_steps": int,
}
_SECTIONS = {
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "fp16": FP16Config,
    "bf16": BF16Config,
    "bfloat16": BF16Config,  # DeepSpeed's older spelling
    "zero_optimization": ZeroConfig,
    "tensorboard": TensorBoardConfig,
    "wandb": WandbConfig,
    "flops_profiler": FlopsProfilerConfig,
    "activation_checkpointing": ActivationCheckpointingConfig,
    "checkpoint": CheckpointConfig,
}


def resolve_batch_triad(train: int | None, micro: int | None, accum: int | None, dp: int) -> tuple[int, int, int]:
    """DeepSpeed's rule: any two of (train, micro, accumulation) give the third; train = micro*accum*dp."""
    for name, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                        ("gradient_accumulation_steps", accum)):
        if value is not None and value < 1:
            raise ConfigError(f"'{name}' must be >= 1, got {value}")
    if train is None and micro is None:
        raise ConfigError("set 'train_batch_size' or 'train_micro_batch_size_per_gpu' (or both)")
    if micro is None:
        accum = accum or 1
        if train % (accum * dp):
            raise ConfigError(f"'train_batch_size' {train} is not divisible by gradient_accumulation_steps "
                              f"{accum} x data-parallel size {dp} = {accum * dp}")
        micro = train // (accum * dp)
    elif train is None:
        accum = accum or 1
        train = micro * accum * dp
    elif accum is None:
        if train % (micro * dp):
            raise ConfigError(f"'train_batch_size' {train} is not divisible by train_micro_batch_size_per_gpu "
                              f"{micro} x data-parallel size {dp} = {micro * dp}")
        accum = train // (micro * dp)
    if train != micro * accum * dp:
        raise ConfigError(
            f"inconsistent batch sizes: train_batch_size {train} != train_micro_batch_size_per_gpu {micro} "
            f"x gradient_accumulation_steps {accum} x data-parallel size {dp} = {micro * accum * dp}")
    return train, micro, accum


def load_config_source(source: str | os.PathLike | dict) -> dict:
    """Read a JSON file path or take a dict (copied), returning the raw dict."""
    if isinstance(source, dict):
        return json.loads(json.dumps(source))
    try:
        with open(source) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {source}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {source} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {source} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _check_bf16_spellings(raw: dict) -> None:
    """`bf16` and its old spelling `bfloat16` name one block: both may be given only if they agree
    (DeepSpeed would silently read `bf16` and drop `bfloat16`)."""
    if "bf16" in raw and "bfloat16" in raw and raw["bf16"] != raw["bfloat16"]:
        raise ConfigError(f"'bf16' {json.dumps(raw['bf16'])} and 'bfloat16' {json.dumps(raw['bfloat16'])} are "
                          f"both given and disagree; they are one block ('bfloat16' is the old spelling): keep one")


def parse_config(source: str | os.PathLike | dict, data_parallel_size: int) -> EngineConfig:
    """Validate a DeepSpeed-style config (path or dict) into an EngineConfig for `data_parallel_size`."""
    raw = load_config_source(source)
    check_known_keys(raw, list(_TOP_LEVEL_SCALARS) + list(_SECTIONS), "")
    _check_bf16_spellings(raw)
    values = {key: _check_type(raw[key], kind, key) if key in raw else None
              for key, kind in _TOP_LEVEL_SCALARS.items()}
    sections = {}
    for key, cls in _SECTIONS.items():
        if key in raw:
            sections["bf16" if key == "bfloat16" else key] = _from_dict(cls, raw[key], key + ".")
    train, micro, accum = resolve_batch_triad(values["train_batch_size"], values["train_micro_batch_size_per_gpu"],
                                              values["gradient_accumulation_steps"], data_parallel_size)
    config = EngineConfig(train, micro, accum, data_parallel_size, **sections,
                          **{k: v for k, v in values.items() if v is not None and k not in (
                              "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")})
    if config.fp16.enabled and config.bf16.enabled:
        raise ConfigError("'fp16.enabled' and 'bf16.enabled' are both true; choose one")
    if config.gradient_clipping < 0:
        raise ConfigError(f"'gradient_clipping' must be >= 0 (0 = off), got {config.gradient_clipping}")
    if config.steps_per_print < 1:
        raise ConfigError(f"'steps_per_print' must be >= 1, got {config.steps_per_print}")
    if config.max_consecutive_skipped_steps < 0:
        raise ConfigError(f"'max_consecutive_skipped_steps' must be >= 0 (0 = off), "
                          f"got {config.max_consecutive_skipped_steps}")
    return config
