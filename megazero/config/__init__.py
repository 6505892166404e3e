"""The engine configuration: a DeepSpeed-compatible JSON file or dict, validated into typed objects.

The models below are the schema: every accepted key with DeepSpeed's meaning, default, bounds
and a one-line description. `optimizer.params` is checked against the params model of its type
(`megazero.optim.registry`), `scheduler.params` against its schedule's (`params_model` in
`megazero.optim.lr_schedules`). Unknown keys, wrong types and out-of-range values raise
:class:`ConfigError` in one line naming the full key path and the value given (with the nearest
valid key as a suggestion); nothing is silently ignored.

`python -m megazero.config schema` prints the JSON Schema (committed as
configs/megazero.schema.json), `python -m megazero.config docs-table` the key table of
docs/engine.md (both made in `megazero.config.schema`).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Literal

from pydantic import AliasChoices, Field, PrivateAttr, ValidationError, field_validator, model_validator

from megazero.config.deprecated import deprecated_offload_switches
from megazero.config_fields import (
    Bool,
    Float,
    Int,
    Section,
    Str,
    any_case_choice,
    config_error,
    error_message,
    field_keys,
    int_choice,
    one_spelling,
    section_type,
    suggest,
    true_only,
    validate_given,
)


class ConfigError(ValueError):
    """A configuration key is unknown, has the wrong type, or holds an invalid value."""


class FP16Config(Section):
    """`fp16`: half precision with a (dynamic by default) loss scale."""

    enabled: Bool = Field(False, description="compute in float16 with fp32 master weights")
    loss_scale: Float = Field(0.0, ge=0, description="static loss scale; 0 = dynamic loss scaling")
    initial_scale_power: Int = Field(16, ge=0, le=64, description="dynamic scaling starts at 2**initial_scale_power")
    loss_scale_window: Int = Field(1000, ge=1, description="clean steps before the dynamic scale doubles")
    hysteresis: Int = Field(2, ge=1, description="overflows tolerated before the dynamic scale halves")
    consecutive_hysteresis: Bool = Field(False, description="refill the hysteresis after every clean step")
    min_loss_scale: Float = Field(1.0, gt=0, description="the dynamic scale never drops below this")
    auto_cast: Bool = Field(False, description="the engine's forward casts floating tensors among its positional "
                                               "inputs to float16 (with fp16.enabled; as DeepSpeed)")
    fp16_master_weights_and_grads: Bool = Field(
        False, description="false only: fp32 master weights and gradients (true, DeepSpeed's fp16 masters for its "
                           "CPU Adam, is not implemented)")

    @model_validator(mode="after")
    def _fp32_masters(self) -> FP16Config:
        if self.auto_cast and not self.enabled:
            warnings.warn("'fp16.auto_cast' has no effect without 'fp16.enabled' (DeepSpeed would cast the inputs of "
                          "a model that does not compute in float16)", stacklevel=2)
        if self.fp16_master_weights_and_grads:
            raise config_error("'{path}' true (fp16 master weights and gradients, DeepSpeed's option for its CPU "
                               "Adam) is not implemented: megazero keeps fp32 masters; use false",
                               "fp16_master_weights_and_grads")
        return self


class BF16Config(Section):
    """`bf16` (or DeepSpeed's older `bfloat16`): bfloat16 compute with fp32 master weights and fp32
    gradient accumulation; giving both spellings is an error unless they are equal (DeepSpeed would
    read `bf16` and drop `bfloat16` silently)."""

    enabled: Bool = Field(False, description="compute in bfloat16 with fp32 master weights")


OffloadDevice = Literal["none", "cpu", "nvme"]


class OffloadOptimizerConfig(Section):
    """`zero_optimization.offload_optimizer` (ZeRO-Offload / ZeRO-Infinity, stages 1-3): where the fp32
    master weights (when they are a copy of a 16-bit model) and the optimizer states live, stepped
    sub-group by sub-group (megazero.zero.offload)."""

    device: OffloadDevice = Field("none", description="none; cpu: host memory (on a CPU-only machine the "
                                                      "in-memory path itself); nvme: swap files under nvme_path")
    nvme_path: Str | None = Field(None, description="directory for the swap files (device nvme; required): "
                                                    "<nvme_path>/megazero-swap/<run id>/rank<r>/, removed at exit")
    pin_memory: Bool = Field(False, description="page-lock the host buffers (with CUDA only; no effect on CPU)")
    buffer_count: Int = Field(4, ge=1, description="sub-group buffers (nvme): 3 overlap the next one's read, this "
                                                   "one's step and the last one's write; at stages 2-3 also "
                                                   "backward's gradient ring, in master chunks")
    fast_init: Bool = Field(False, description="accepted for DeepSpeed; optimizer states are always created by "
                                               "the first step, sub-group by sub-group, never staged at start-up")
    ratio: Float = Field(1.0, gt=0, le=1, description="share of the optimizer offloaded (only 1.0: partial "
                                                      "offload is not implemented)")

    @model_validator(mode="after")
    def _implemented(self) -> OffloadOptimizerConfig:
        if self.ratio != 1.0:
            raise config_error(f"'{{path}}'={self.ratio:g} is not implemented yet (partial offload); use 1.0",
                               "ratio")
        if self.device == "nvme" and not self.nvme_path:
            raise config_error("'{where}device'='nvme' needs '{path}' (a directory for the swap files)",
                               "nvme_path")
        return self


class OffloadParamConfig(Section):
    """`zero_optimization.offload_param` (ZeRO-Infinity, stage 3 only): where the partitioned 16-bit
    parameters live between uses (megazero.zero.param_offload)."""

    device: OffloadDevice = Field("none", description="none; cpu: host memory (on a CPU-only machine the in-memory "
                                                      "path itself); nvme: each rank's partitions in swap files, "
                                                      "read back ahead of use")
    nvme_path: Str | None = Field(None, description="directory for the parameter swap files (device nvme; "
                                                    "required): <nvme_path>/megazero-swap/<run id>/rank<r>/")
    pin_memory: Bool = Field(False, description="page-lock the host buffers: the partitions (device cpu), the pool "
                                                "buffers (nvme) (with CUDA only; no effect on CPU)")
    buffer_count: Int = Field(5, ge=1, description="buffers in the pool (nvme) that partitions are read into, "
                                                   "reused, 4096-aligned; cached partitions (max_in_cpu) hold one "
                                                   "too, given back when a read needs it")
    buffer_size: Int = Field(100_000_000, ge=1, description="elements per pool buffer: no partition may be larger "
                                                            "(an error names it); a buffer is made at first use, "
                                                            "of the largest partition's size")
    max_in_cpu: Int = Field(1_000_000_000, ge=0, description="partition elements kept cached in host memory "
                                                             "after use (nvme; least recently used dropped first)")


class ZeroConfig(Section):
    """`zero_optimization`: stage 0 is plain data parallelism with bucketed all-reduce; stage 1
    partitions the fp32 master weights and optimizer states; stage 2 the gradients too; stage 3 the
    16-bit parameters as well."""

    stage: int_choice(0, 1, 2, 3) = Field(
        0, description="ZeRO stage: 0 (replicated), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters)")
    reduce_bucket_size: Int = Field(
        500_000_000, ge=1, description="elements per gradient bucket: a bucket closes at the first parameter "
                                       "that brings it to this size (at stage 3 buckets span layers)")
    # DeepSpeed defaults this to true at stage 3 only, where its overlap at stages 1-2 costs extra
    # buffers; here overlap costs stages 0-1 nothing (in-place reductions of the full buffer) and
    # false makes stage 2 keep every bucket's buffer until backward ends: the whole gradient
    overlap_comm: Bool = Field(True, description="reduce a bucket during the rest of backward, as soon as it fills "
                                                 "(false: stages 0-2 reduce after backward, stage 3 waits for "
                                                 "each bucket). True at every stage, unlike DeepSpeed (stage 3 "
                                                 "only): false saves no memory here")
    stage3_param_persistence_threshold: Int = Field(
        100_000, ge=0,
        validation_alias=AliasChoices("stage3_param_persistence_threshold", "param_persistence_threshold"),
        description="stage 3: parameters smaller than this stay whole on every rank")
    stage3_prefetch_bucket_size: Int = Field(
        50_000_000, ge=0, validation_alias=AliasChoices("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
        description="stage 3: prefetch the next layer's parameters up to this size (0: off)")
    stage3_module_granularity_threshold: Int = Field(
        0, ge=0, validation_alias=AliasChoices("stage3_module_granularity_threshold", "module_granularity_threshold"),
        description="stage 3: a module whose subtree averages at most this many parameter elements "
                             "per module is fetched as one unit with its children (0: every module owning "
                             "parameters is a unit)")
    contiguous_gradients: true_only("megazero always keeps gradients in contiguous buffers") = Field(
        True, description="gradient partitions are always one contiguous buffer here (true only)")
    reduce_scatter: Bool = Field(
        True, description="stages 1-3 always reduce-scatter the gradients (false: a warning, no effect: an "
                          "all-reduce gives the same average)")

    @field_validator("reduce_scatter")
    @classmethod
    def _reduce_scatter_always(cls, value: bool) -> bool:
        if value is False:
            warnings.warn("config key 'zero_optimization.reduce_scatter' false has no effect in megazero: stages 1-3 "
                          "always reduce-scatter the gradients (an all-reduce gives the same average)", stacklevel=2)
        return True
    stage3_gather_16bit_weights_on_model_save: Bool = Field(
        False, validation_alias=AliasChoices("stage3_gather_16bit_weights_on_model_save",
                                             "gather_16bit_weights_on_model_save",
                                             "stage3_gather_fp16_weights_on_model_save"),
        description="save_16bit_model() gathers stage 3's weights (false: it warns and writes nothing)")
    offload_optimizer: OffloadOptimizerConfig = Field(
        default_factory=OffloadOptimizerConfig, description="optimizer offload (stages 1-3)")
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig,
                                              description="parameter offload (stage 3)")
    allgather_partitions: Bool = Field(
        True, description="stages 1-2: the updated parameters reach every rank by one all-gather per bucket "
                          "(false: one broadcast from each rank)")
    allgather_bucket_size: Int = Field(
        500_000_000, ge=1, description="stages 1-2: elements per parameter all-gather (a larger reduce bucket is "
                                       "gathered in pieces of this size)")
    sub_group_size: Int = Field(
        1_000_000_000, ge=1, description="offload: the optimizer steps this many elements at a time (runs of "
                                         "whole master chunks; a chunk, 1/N of a reduce bucket, is never split)")

    _averaging: tuple[bool, float] = PrivateAttr((False, 1.0))

    @property
    def prescale_gradients(self) -> bool:
        """The config's top-level `prescale_gradients` (handed down by EngineConfig)."""
        return self._averaging[0]

    @property
    def gradient_predivide_factor(self) -> float:
        """The config's top-level `gradient_predivide_factor` (handed down by EngineConfig)."""
        return self._averaging[1]

    @model_validator(mode="before")
    @classmethod
    def _null_blocks(cls, raw: Any) -> Any:
        if isinstance(raw, dict):  # DeepSpeed configs write an unused offload block as null
            raw = one_spelling(cls, raw)
            raw = deprecated_offload_switches(raw)
            raw = {k: ({} if k in ("offload_optimizer", "offload_param") and v is None else v) for k, v in raw.items()}
        return raw

    @model_validator(mode="after")
    def _offload_needs_stage(self) -> ZeroConfig:
        if self.offload_optimizer.device != "none" and self.stage == 0:
            raise config_error(f"'{{path}}'={self.offload_optimizer.device!r} needs 'zero_optimization.stage' 1, "
                               f"2 or 3, got 0 (as in DeepSpeed)", "offload_optimizer", "device")
        if self.offload_param.device != "none":
            if self.stage != 3:
                raise config_error(f"'{{path}}'={self.offload_param.device!r} needs 'zero_optimization.stage' 3, "
                                   f"got {self.stage} (as in DeepSpeed)", "offload_param", "device")
            if self.offload_param.device == "nvme" and not self.offload_param.nvme_path:
                raise config_error("'{where}device'='nvme' needs '{path}' (a directory for the swap files)",
                                   "offload_param", "nvme_path")
        return self


class TensorBoardConfig(Section):
    """`tensorboard`: scalars written by rank 0 to output_path/job_name."""

    enabled: Bool = Field(False, description="write TensorBoard scalars")
    output_path: Str = Field("", description="directory of the event files")
    job_name: Str = Field("megazero", description="subdirectory of output_path for this run")


class WandbConfig(Section):
    """`wandb`: run by rank 0, offline unless WANDB_API_KEY is set (or WANDB_MODE says otherwise)."""

    enabled: Bool = Field(False, description="log to Weights & Biases (rank 0)")
    team: Str | None = Field(None, description="the W&B entity")
    group: Str | None = Field(None, description="the W&B run group")
    project: Str = Field("megazero", description="the W&B project")


class FlopsProfilerConfig(Section):
    """`flops_profiler`: profile the forward of one step (DeepSpeed's keys); rank 0 prints or writes it."""

    enabled: Bool = Field(False, description="profile one forward")
    profile_step: Int = Field(1, ge=1, description="the optimizer step (1-based) whose first forward is profiled")
    module_depth: Int = Field(-1, ge=-1, description="depth of the module tree shown; -1: every depth")
    top_modules: Int = Field(1, ge=1, description="modules listed per depth, most FLOPs first")
    detailed: Bool = Field(True, description="print the per-module tree")
    output_file: Str | None = Field(None, description="write the profile here (null: print on rank 0)")


class ActivationCheckpointingConfig(Section):
    """`activation_checkpointing`: options of megazero.activation_checkpointing.configure
    (DeepSpeed's keys), with the mpu's tensor-parallel group."""

    partition_activations: Bool = Field(False, description="split each checkpointed input across the TP ranks")
    cpu_checkpointing: Bool = Field(False, description="keep the (partitioned) checkpoints in CPU memory")
    contiguous_memory_optimization: Bool = Field(
        False, description="copy checkpoints into preallocated buffers (needs partitioning and number_checkpoints)")
    number_checkpoints: Int | None = Field(None, ge=1, description="checkpoints per step: the buffer slots")
    synchronize_checkpoint_boundary: Bool = Field(
        False, description="synchronize the device before and after each checkpointed forward and recompute")
    profile: Bool = Field(False, description="time each checkpointed forward and recompute (rank 0 prints)")

    @model_validator(mode="after")
    def _contiguous_needs(self) -> ActivationCheckpointingConfig:
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise config_error("'{path}' needs '{where}partition_activations' (as in DeepSpeed)",
                               "contiguous_memory_optimization")
        if self.contiguous_memory_optimization and not self.number_checkpoints:
            raise config_error("'{path}' needs '{where}number_checkpoints' (buffer slots)",
                               "contiguous_memory_optimization")
        return self


TAG_VALIDATION_MODES = ("Warn", "Ignore", "Fail")


class CheckpointConfig(Section):
    """`checkpoint`: how save_checkpoint() and load_checkpoint() treat tags that differ across ranks
    (DeepSpeed's keys; every rank uses rank 0's tag), verify what they load, and how many tags they keep."""

    tag_validation: any_case_choice(TAG_VALIDATION_MODES) = Field(
        "WARN", description="Warn names the ranks that differ, Fail raises, Ignore is silent (any case; "
                            "stored upper-case)")
    verify: Bool = Field(False, description="load_checkpoint() checks every file's checksum against the manifest "
                                            "(file sizes are always checked)")
    keep_last: Int = Field(0, ge=0, description="after a save completes, delete all but the newest K complete tags "
                                                "(never the one `latest` names); 0 keeps all")


# DeepSpeed has no such block; exiting lets the launcher end the job instead of leaving it hung
class WatchdogConfig(Section):
    """`watchdog` (megazero.watchdog): a rank waiting longer than `timeout` in a collective or p2p
    operation for a stopped, dead or deadlocked peer names the operation and the missing ranks and
    exits (code 75). Off by default; the recipes' configs turn it on."""

    enabled: Bool = Field(False, description="run the hung-rank watchdog (a heartbeat thread per rank)")
    timeout: Float = Field(60.0, ge=5, le=1800, description="seconds an operation may wait for a stopped, dead or "
                                                          "deadlocked peer before the job exits (a live peer that "
                                                          "is saving or evaluating is waited for); at most the "
                                                          "process group's timeout, 1800 s")


# DeepSpeed has a block of this name for its PipelineModule; megazero reads these keys of it
class PipelineConfig(Section):
    """`pipeline`: how the pipeline stages are built and linked. The model is built before
    initialize(), so build it with these keys (virtual_stage_layers(), pipeline_partition_method());
    initialize() checks the model against them."""

    num_layers_per_virtual_stage: Int | None = Field(
        None, ge=1, description="interleaved 1F1B (Megatron's --num-layers-per-virtual-pipeline-stage, which must "
                                "agree): each stage holds num_layers / (PP x this) model chunks; null: one chunk")
    # compute: the last stage's output layer and loss over the vocabulary count as the compute they
    # cost (Megatron's account_for_loss_in_pipeline_split); measured: a layer's, the embeddings' and
    # the head and loss's forward + backward timed at build time on every rank (GPT and Llama); with
    # v > 1 chunks both take the split whose interleaved schedule simulates the shortest step at the
    # run's micro-batches per step (megazero.pipeline.schedule_simulation); checkpoints load at any
    partition_method: Literal["parameters", "compute", "measured"] = Field(
        "parameters", description="which layers each stage holds (--pipeline-partition-method): balanced by "
                                  "parameter count (DeepSpeed's default), by forward FLOPs with the head and loss "
                                  "counted, or by forward + backward time measured at build time")
    # shared memory (megazero.pipeline.shm_link): the main threads copy the bytes, where gloo's one tcp
    # thread per process must get a core for every message. Each linked pair reserves two rings of
    # $MEGAZERO_P2P_SHM_RING_BYTES (64 MiB) in /dev/shm; where they do not fit (a default Docker
    # container's 64 MB) auto warns and uses the process group
    # zb-h1 and zbv (Qi et al. 2024): each backward split into B (input gradients) and W (weight
    # gradients, megazero.tensor_parallel.weight_grad); zb-h1 keeps 1F1B's order and memory with the
    # W's where 1F1B waits, zbv runs two chunks per stage in a V (megazero.pipeline.actions)
    schedule: Literal["1f1b", "interleaved", "zb-h1", "zbv"] = Field(
        "1f1b", description="the pipeline schedule (--pipeline-schedule): 1f1b (interleaved when the stages "
                            "hold several model chunks), interleaved (1f1b that requires them: "
                            "num_layers_per_virtual_stage), zb-h1 (zero-bubble H1: backward split into input "
                            "and weight gradients, the weight gradients filling 1F1B's bubbles; one chunk "
                            "per stage), or zbv (zero-bubble V: two model chunks per stage, the first stage "
                            "holding the first and the last; at least 2 x PP micro-batches); ZeRO 0-2")
    p2p_transport: Literal["auto", "backend", "shm"] = Field(
        "auto", description="how stages exchange activations: auto: shared memory between ranks on one host "
                            "with CPU tensors (2 x 64 MiB of /dev/shm per link), else the process group; "
                            "backend: the process group; shm: shared memory or an error. "
                            "$MEGAZERO_P2P_TRANSPORT overrides it")

    @model_validator(mode="after")
    def _schedule_chunks(self) -> PipelineConfig:
        chunks = self.num_layers_per_virtual_stage
        if self.schedule in ("zb-h1", "zbv") and chunks is not None:
            what = "one model chunk" if self.schedule == "zb-h1" else "two model chunks in a V"
            raise config_error(f"'{{where}}schedule'={self.schedule!r} runs {what} per stage: unset '{{path}}' "
                               f"(--num-layers-per-virtual-pipeline-stage), or use 1f1b (or interleaved) for the "
                               f"interleaved schedule", "num_layers_per_virtual_stage")
        if self.schedule == "interleaved" and chunks is None:
            raise config_error("'{where}schedule'='interleaved' needs '{path}' "
                               "(--num-layers-per-virtual-pipeline-stage): the layers of each model chunk",
                               "num_layers_per_virtual_stage")
        return self


# an engine key, not a model one: megazero.tensor_parallel.invariant_dropout's docstring says why.
# Off: streams keyed by step, micro-batch and layer, and torch's attention kernel. On: 1.04x the CPU
# time of a forward + backward (GPT hidden 256, 4 layers, seq 128, batch 8, dropout 0.1, fp32, one
# thread: 530 vs 509 ms, medians of 15 alternating trials; not measured on a GPU, where the
# default's fused attention likely costs more)
class DropoutMasksConfig(Section):
    """`dropout_masks` (megazero's own block): how training forwards key their dropout masks: one
    mask per micro-batch (equal across layouts that keep the micro-batch size), or one per sample
    and attention head (equal at any micro-batch size, DP, TP, SP, PP, v and EP; a little slower)."""

    layout_invariant: Bool = Field(
        False, description="draw every dropout mask per sample (and attention head) from (seed, step, sample, "
                           "layer, site), so that any micro-batch size, DP, TP, SP, PP or EP layout draws the "
                           "same masks (slower)")


def _optimizers() -> dict:
    # lazy: megazero.optim imports the builder, which imports this module
    from megazero.optim.registry import OPTIMIZERS

    return OPTIMIZERS


def _schedulers() -> dict:
    from megazero.optim.lr_schedules import SCHEDULERS  # lazy: it imports torch

    return SCHEDULERS


class _TypedBlock(Section):
    """A {"type", "params"} block: `type` names an entry of a registry, whose params model checks
    `params` (which stays a dict of only the keys given)."""

    @classmethod
    def _unknown(cls) -> str:
        return "is not supported"

    @classmethod
    def _models(cls) -> dict[str, type]:
        """{registry key: params model}."""
        raise NotImplementedError

    @classmethod
    def _names(cls) -> list[str]:
        return list(cls._models())

    @classmethod
    def _key(cls, type_name: str) -> str:
        return type_name

    @classmethod
    def _missing(cls, type_name: str) -> str | None:
        """Why `type_name` is a type DeepSpeed has and megazero lacks, or None."""
        return None

    @field_validator("type", check_fields=False)
    @classmethod
    def _known_type(cls, value: str) -> str:
        models = cls._models()
        if cls._key(value) not in models and cls._missing(value) is not None:
            raise config_error(f"'{{path}}' {value!r} is {cls._missing(value)}; choose one of "
                               f"{', '.join(cls._names())}")
        if cls._key(value) not in models:
            raise config_error(f"'{{path}}' {value!r} {cls._unknown()}{suggest(cls._key(value), models)}; "
                               f"choose one of {', '.join(cls._names())}")
        return value

    @field_validator("params", check_fields=False)
    @classmethod
    def _params_of_type(cls, value: dict, info) -> dict:
        if "type" not in info.data:  # the type was wrong: that is the error reported
            return value
        return validate_given(cls._models()[cls._key(info.data["type"])], value)


_MUP = "DeepSpeed's muP optimizer (maximal update parametrization), not implemented in megazero"
# optimizer types DeepSpeed builds from its config that megazero does not (any case): why
DEEPSPEED_ONLY_OPTIMIZERS = {"muadam": _MUP, "muadamw": _MUP, "musgd": _MUP,
                             "muon": "DeepSpeed's Muon optimizer, not implemented in megazero"}


class OptimizerConfig(_TypedBlock):
    """`optimizer`: {"type": one of megazero.optim.registry.OPTIMIZERS, "params": {...}}; on CPU the C++
    op runs Adam, AdamW, Lamb and Adagrad unless `torch_adam: true`."""

    type: Str = Field("AdamW", description="the optimizer, any case")
    params: dict[str, Any] = Field(default_factory=dict, description="the optimizer's keys (per type, below)")

    @classmethod
    def _models(cls) -> dict[str, type]:
        return {key: spec.params for key, spec in _optimizers().items()}

    @classmethod
    def _names(cls) -> list[str]:
        return [spec.name for spec in _optimizers().values()]

    @classmethod
    def _key(cls, type_name: str) -> str:
        return type_name.lower()

    @classmethod
    def _missing(cls, type_name: str) -> str | None:
        return DEEPSPEED_ONLY_OPTIMIZERS.get(type_name.lower())

    @field_validator("params", mode="before")
    @classmethod
    def _no_clipping_in_params(cls, value: Any) -> Any:
        # DeepSpeed's parser passes it and its engine refuses it when it builds the optimizer: say so here
        if isinstance(value, dict) and "max_grad_norm" in value:
            raise config_error("'{path}.max_grad_norm' is not an optimizer parameter (DeepSpeed's engine refuses it "
                               "too): clip with the top-level 'gradient_clipping'")
        return value


class SchedulerConfig(_TypedBlock):
    """`scheduler`: {"type": one of megazero.optim.lr_schedules.SCHEDULERS, "params": {...}}, with
    DeepSpeed's names, parameters and defaults."""

    type: Str = Field("WarmupLR", description="the LR schedule (case-sensitive, as in DeepSpeed)")
    params: dict[str, Any] = Field(default_factory=dict, description="the schedule's keys (per type, below)")

    @classmethod
    def _unknown(cls) -> str:
        return "is not a known scheduler"

    @classmethod
    def _models(cls) -> dict[str, type]:
        return {name: schedule.params_model for name, schedule in _schedulers().items()}


class AioConfig(Section):
    """`aio`: the asynchronous I/O op (megazero.ops.aio) that swaps offloaded states to NVMe."""

    block_size: Int = Field(1_048_576, ge=4096, description="bytes per read/write request")
    queue_depth: Int = Field(8, ge=1, description="requests in flight per thread")
    thread_count: Int = Field(1, ge=1, validation_alias=AliasChoices("thread_count", "intra_op_parallelism"),
                              description="I/O threads ('intra_op_parallelism' is DeepSpeed's name)")
    single_submit: Bool = Field(False, description="submit requests one at a time (false: in batches)")
    overlap_events: Bool = Field(True, description="overlap submitting new requests with completing earlier ones")


class EngineConfig(Section):
    """The whole engine configuration (DeepSpeed's keys), with the batch-size triad resolved for a
    data-parallel size by parse_config()."""

    train_batch_size: Int | None = Field(
        None, ge=1, description="samples per optimizer step over all data-parallel ranks; any two of the triad "
                                "give the third: train = micro x accumulation x data-parallel size")
    train_micro_batch_size_per_gpu: Int | None = Field(None, ge=1, description="samples per forward on one rank")
    gradient_accumulation_steps: Int | None = Field(None, ge=1, description="micro-batches per optimizer step")
    optimizer: OptimizerConfig | None = Field(None, description="the optimizer built by initialize()")
    scheduler: SchedulerConfig | None = Field(None, description="the LR schedule built by initialize()")
    fp16: FP16Config = Field(default_factory=FP16Config, description="float16 compute and loss scaling")
    bf16: BF16Config = Field(default_factory=BF16Config, validation_alias=AliasChoices("bf16", "bfloat16"),
                             description="bfloat16 compute ('bfloat16' is DeepSpeed's older spelling)")
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO partitioning")
    gradient_clipping: Float = Field(0.0, ge=0, description="clip the global gradient norm to this; 0 = off")
    prescale_gradients: Bool = Field(
        False, description="stage 0: divide gradients by the data-parallel size before their all-reduce (false: by "
                           "gradient_predivide_factor before, the rest after); stages 1-3 divide first and refuse it")
    gradient_predivide_factor: Float = Field(
        1.0, gt=0, description="stage 0 with prescale_gradients false: gradients are divided by this before their "
                               "all-reduce and by data-parallel size / this after it (stages 1-3 refuse it)")
    zero_allow_untested_optimizer: Bool = Field(
        False, description="ZeRO stages 1-3 accept an optimizer passed to initialize() that is not one megazero "
                           "builds (whose update may read whole tensors, which ZeRO partitions)")
    steps_per_print: Int = Field(10, ge=1, description="print progress every this many optimizer steps")
    wall_clock_breakdown: Bool = Field(False, description="time forward, backward and step (synchronizing)")
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig, description="TensorBoard scalars")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases logging")
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig, description="FLOPs profile")
    activation_checkpointing: ActivationCheckpointingConfig | None = Field(
        None, description="activation checkpointing options (absent: configure() is not called)")
    seed: Int | None = Field(None, ge=0, lt=2**32, description="seed python, numpy and torch before building")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig,
                                         description="checkpoint tag checks, verification, retention")
    # megazero's own key (DeepSpeed has none). 100 is longer than any loss-scale search a healthy fp16
    # run makes (from 2**64, the largest initial_scale_power, to a scale of 1 is 65 skips with the
    # default hysteresis 2), yet stops a diverged run instead of letting it skip forever
    max_consecutive_skipped_steps: Int = Field(
        100, ge=0, description="stop with NumericsError after this many consecutive skipped steps (fp16 "
                               "overflows, inf/nan gradients or losses in any precision); 0 = never")
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig, description="the hung-rank watchdog")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="pipeline model chunks")
    aio: AioConfig = Field(default_factory=AioConfig, description="asynchronous I/O for NVMe offload")
    dropout_masks: DropoutMasksConfig = Field(default_factory=DropoutMasksConfig,
                                              description="how training forwards key their dropout masks")

    _data_parallel_size: int = PrivateAttr(1)

    @property
    def data_parallel_size(self) -> int:
        """The data-parallel size the batch triad was resolved for."""
        return self._data_parallel_size

    @property
    def compute_dtype(self):
        """The dtype the model computes in: float16, bfloat16 or float32."""
        import torch

        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32

    @model_validator(mode="before")
    @classmethod
    def _spellings_and_nulls(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        # `bf16` and `bfloat16` name one block: both only if they agree (DeepSpeed would silently
        # read `bf16` and drop `bfloat16`)
        if "bf16" in raw and "bfloat16" in raw:
            if raw["bf16"] != raw["bfloat16"]:
                raise config_error(f"'bf16' {json.dumps(raw['bf16'])} and 'bfloat16' {json.dumps(raw['bfloat16'])} "
                                   f"are both given and disagree; they are one block ('bfloat16' is the old "
                                   f"spelling): keep one")
            del raw["bfloat16"]
        for key, info in cls.model_fields.items():  # a block given as null is the block's defaults
            for name in field_keys(key, info):
                if name in raw and raw[name] is None and section_type(info.annotation) is not None:
                    raw[name] = {}
        return raw

    @model_validator(mode="after")
    def _one_precision(self) -> EngineConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise config_error("'fp16.enabled' and 'bf16.enabled' are both true; choose one", "fp16", "enabled")
        return self

    @model_validator(mode="after")
    def _averaging_to_zero(self) -> EngineConfig:
        # DeepSpeed keeps these keys at the top; the data-parallel state is built from the zero block
        self.zero_optimization._averaging = (self.prescale_gradients, self.gradient_predivide_factor)
        return self


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


def validate_config(raw: dict) -> EngineConfig:
    """Validate a raw config dict into an EngineConfig (the triad as given, not yet resolved).
    DeepSpeed's keys megazero's schema does not hold are screened first (megazero.config.
    deepspeed_keys): those without effect here warn and are dropped, the others are refused."""
    from megazero.config.deepspeed_keys import RefusedKey, UnknownKey, screen

    try:
        raw = screen(raw, EngineConfig)
    except (RefusedKey, UnknownKey) as e:
        raise ConfigError(str(e)) from None
    try:
        return EngineConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(error_message(EngineConfig, e)) from None


def pipeline_partition_method(source: str | os.PathLike | dict) -> str:
    """The config's `pipeline.partition_method` (validated; "parameters" when not set): what to
    build the model with, `models.parallelize.parallelize(config, grid, ..., partition_method=it)`."""
    return validate_config(load_config_source(source)).pipeline.partition_method


def virtual_stage_layers(source: str | os.PathLike | dict) -> int | None:
    """The config's `pipeline.num_layers_per_virtual_stage` (validated; None when not set): what to
    build the model with, `models.parallelize.parallelize(config, grid, virtual_stage_layers(source))`,
    before passing it and the same config to megazero.initialize()."""
    return validate_config(load_config_source(source)).pipeline.num_layers_per_virtual_stage


def parse_config(source: str | os.PathLike | dict, data_parallel_size: int) -> EngineConfig:
    """Validate a DeepSpeed-style config (path or dict) into an EngineConfig for `data_parallel_size`."""
    config = validate_config(load_config_source(source))
    train, micro, accum = resolve_batch_triad(config.train_batch_size, config.train_micro_batch_size_per_gpu,
                                              config.gradient_accumulation_steps, data_parallel_size)
    config = config.model_copy(update={"train_batch_size": train, "train_micro_batch_size_per_gpu": micro,
                                       "gradient_accumulation_steps": accum})
    config._data_parallel_size = data_parallel_size
    return config
