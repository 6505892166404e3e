"""What megazero does with each config key DeepSpeed defines, and the screen that applies it.

Every key of DeepSpeed 0.19 (configs/deepspeed_keys.json, made by megazero.config.deepspeed_walk)
is in one class:

- implemented: a key of megazero's schema (`megazero.config`) with DeepSpeed's meaning, or one that
  a block's validator reads (`IMPLEMENTED_ELSEWHERE`: DeepSpeed's deprecated switches);
- accepted without effect: dropped with one warning naming the key and why (a GPU- or NCCL-only
  tuning knob, a diagnostic megazero does not print, a deprecated alias);
- refused: an error naming the DeepSpeed feature megazero lacks. Most refusals only apply when the
  value turns the feature on: `data_efficiency` with `"enabled": false`, `use_gds: false`, ... is
  accepted without effect (`Rule.off`).

A rule on a block covers every key below it. A key nobody defines is an unknown key: an error
with the nearest key as a suggestion, or, with MEGAZERO_UNKNOWN_CONFIG_KEYS=warn in the
environment, a warning and the key dropped (for a config that must run unchanged, such as one
carrying `cuda_visible_devices`).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from megazero.config_fields import dotted, field_keys, key_names, section_type, suggest

KEY_LIST = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "deepspeed_keys.json")
UNKNOWN_KEYS_ENV = "MEGAZERO_UNKNOWN_CONFIG_KEYS"  # "warn": unknown keys warn and are dropped; else errors

IMPLEMENTED = "implemented"
NO_EFFECT = "accepted without effect"
REFUSED = "refused"
MEGAZERO_ONLY = "megazero only"


@dataclass(frozen=True)
class Rule:
    """What megazero does with a DeepSpeed key megazero's schema does not hold.

    `refused`: the key is an error naming `why` (the feature megazero lacks), unless `off(value)`
    says the value leaves that feature off: then, as a key with `refused` false, it is dropped with
    a warning that says `why`. `off_text` says which values are off, for the docs."""

    why: str
    refused: bool = False
    off: Callable[[Any], bool] | None = None
    off_text: str = ""

    def applies(self, value: Any) -> str:
        """NO_EFFECT or REFUSED for `value`."""
        if not self.refused or (self.off is not None and self.off(value)):
            return NO_EFFECT
        return REFUSED

    @property
    def label(self) -> str:
        """The class as the docs' key table writes it."""
        if not self.refused:
            return NO_EFFECT
        return f"{REFUSED} (no effect when {self.off_text})" if self.off_text else REFUSED


def _is(expected: Any) -> Callable[[Any], bool]:
    """The value (in any case, as DeepSpeed lowercases these strings) is `expected`, or absent."""
    def accepts(value: Any) -> bool:
        return value is None or value == expected or (isinstance(value, str) and value.lower() == expected)
    return accepts


def _disabled(value: Any) -> bool:
    """A block that is absent-like or says `"enabled": false`."""
    return value is None or value is False or value == {} or (isinstance(value, dict) and value.get("enabled") is False)


def _default_data_types(value: Any) -> bool:
    """`data_types` as DeepSpeed's defaults leave it (fp32 gradient accumulation is megazero's own)."""
    return value is None or (isinstance(value, dict) and value.get("grad_accum_dtype") in (None, "fp32")
                             and value.get("param_dtype") is None and value.get("buffer_dtype") is None
                             and value.get("keep_in_fp32_modules", "auto") == "auto")


def _no_effect(why: str) -> Rule:
    return Rule(why)


def _refused(why: str, off: Callable[[Any], bool] | None = None, off_text: str = "") -> Rule:
    return Rule(why, True, off, off_text)


def _refused_unless_false(why: str) -> Rule:
    return _refused(why, _is(False), "false")


def _refused_unless_disabled(why: str) -> Rule:
    return _refused(why, _disabled, '"enabled": false')


_REMOVED = "removed from DeepSpeed itself (0.19 refuses it too)"
_NCCL = "a GPU/NCCL communication tuning knob; megazero's collectives are chosen per backend"
_STAGE3_CACHE = ("a ZeRO-3 parameter cache knob: megazero's stage 3 releases a unit's parameters after use and "
                 "prefetches by stage3_prefetch_bucket_size")
_LAYOUT_FREE = "megazero's load_checkpoint() reshards a checkpoint of any layout itself"
_PIPELINE_MODULE = ("an option of DeepSpeed's PipelineModule; megazero's pipeline comes from the model's layout "
                    "(pipeline.partition_method, parallel_state)")

# DeepSpeed keys megazero's schema does not hold, by dotted path (a block's rule covers its keys)
RULES: dict[str, Rule] = {
    # ---- top level ---------------------------------------------------------------------------
    "autotuning": _refused_unless_disabled("DeepSpeed Autotuning (searching ZeRO stages and micro-batch sizes)"),
    "comet": _refused_unless_disabled("the Comet monitor (megazero logs to TensorBoard and W&B)"),
    "csv_monitor": _refused_unless_disabled("the CSV monitor (megazero logs to TensorBoard and W&B)"),
    "comms_logger": _no_effect("DeepSpeed's communication logger; megazero counts its own traffic "
                               "(megazero.zero.collectives.traffic)"),
    "communication_data_type": _refused(
        "choosing the gradient reduction's dtype (megazero reduces fp32 gradient buffers)", _is("fp32"),
        'null or "fp32"'),
    "compile": _refused("DeepSpeed's torch.compile integration and DeepCompile",
                        lambda v: _disabled(v) or (isinstance(v, dict) and not v.get("deepcompile", False)),
                        '"deepcompile": false'),
    "data_efficiency": _refused_unless_disabled(
        "DeepSpeed Data Efficiency: curriculum learning and data sampling, random-LTD data routing"),
    "data_parallel_size": _no_effect("the data-parallel size comes from megazero's process groups "
                                     "(megazero.parallel_state)"),
    "data_types": _refused(
        "choosing the parameter, buffer and gradient-accumulation dtypes (megazero accumulates fp32 gradients "
        "for 16-bit models)", _default_data_types, 'the defaults (grad_accum_dtype null or "fp32", the others unset)'),
    "dataloader_drop_last": _no_effect("megazero's training data loader always drops the last incomplete "
                                       "global micro-batch (DeepSpeed keeps it unless this is true)"),
    "datastates_ckpt": _refused(
        "DataStates asynchronous checkpointing", lambda v: v is None or v is False or v == {}, "null or false"),
    "disable_allgather": _no_effect("a legacy DeepSpeed ZeRO switch; see zero_optimization.allgather_partitions"),
    "disable_python_gc": _no_effect("Python's cyclic garbage collector is left as it is"),
    "dump_state": _no_effect("DeepSpeed's dump of its engine state at start-up; megazero prints none"),
    "expert_parallel": _refused_unless_disabled(
        "DeepSpeed AutoEP (expert parallelism injected into a Hugging Face model); megazero's MoE layers "
        "are megazero.moe"),
    "gradient_allreduce_op": _refused("summing instead of averaging the data-parallel gradients", _is("mean"),
                                      '"mean"'),
    "hybrid_engine": _refused_unless_disabled("DeepSpeed-Chat's hybrid engine (RLHF generation)"),
    "log_level": _no_effect("DeepSpeed's logger level; megazero writes warnings and rank 0's progress"),
    "managed_gradient_accumulation": _refused(
        "client-owned accumulation boundaries (every step() an update)", _is(True), "true"),
    "memory_breakdown": _no_effect("a per-step memory print; megazero reports memory through its monitors"),
    "optimizer.legacy_fusion": _no_effect("Apex's legacy fused fp16 optimizer; megazero's fp16 path is its own"),
    "seq_parallel_communication_data_type": _no_effect(
        "DeepSpeed-Ulysses' gradient dtype; megazero's sequence parallelism is Megatron's"),
    "sequence_parallel_size": _refused(
        "DeepSpeed-Ulysses sequence parallelism (megazero's sequence parallelism is Megatron's, in the model's "
        "layout)", _is(1), "1"),
    "tensor_parallel": _refused(
        "DeepSpeed AutoTP (tensor parallelism injected into a Hugging Face model); megazero's models are built "
        "tensor-parallel (megazero.tensor_parallel)",
        lambda v: v is None or v == {} or (isinstance(v, dict) and v.get("autotp_size", 0) in (0, 1)),
        '"autotp_size" 0 or 1'),
    "timers": _no_effect("DeepSpeed's throughput timer; megazero's progress lines report samples/s "
                         "(wall_clock_breakdown times forward, backward and step)"),
    "torch_autocast": _refused_unless_disabled("torch.autocast mixed precision (use bf16 or fp16)"),
    "use_data_before_expert_parallelism": _refused_unless_false(
        "DeepSpeed's expert-data process-group order (megazero.parallel_state builds its own)"),
    "weight_quantization": _refused_unless_disabled("weight quantization"),
    "zero_force_ds_cpu_optimizer": _no_effect("offloaded optimizers are stepped by megazero's own CPU ops or the "
                                              "optimizer given"),
    # ---- bf16 / fp16 / checkpoint / aio / flops_profiler --------------------------------------
    "bf16.immediate_grad_update": _no_effect("a timing option of DeepSpeed's BF16 optimizer; megazero updates at "
                                             "the step"),
    "bf16.check_grad_overflow": _refused(
        "stepping over inf/nan gradients (megazero checks them in every precision)", _is(True), "true"),
    "bf16.bf16_master_weights_and_grads": _refused_unless_false("bf16 master weights and gradients (megazero keeps "
                                                                "fp32 masters)"),
    "bf16.bf16_optimizer_states": _refused_unless_false("bf16 optimizer states (megazero keeps fp32 states)"),
    "checkpoint.checkpoint_serialization": _no_effect("megazero's checkpoint files have one format "
                                                      "(megazero.checkpoint.io)"),
    "checkpoint.load_universal": _no_effect(_LAYOUT_FREE),
    "checkpoint.parallel_write": _no_effect("a write-parallelism knob; each megazero rank writes its own files"),
    "checkpoint.use_node_local_storage": _refused_unless_false("checkpoints on node-local storage"),
    "checkpoint.writer": _no_effect("DeepSpeed's FastPersist writer; megazero's checkpoint writer is its own"),
    "aio.use_gds": _refused_unless_false("GPUDirect Storage"),
    "flops_profiler.recompute_fwd_factor": _no_effect("DeepSpeed's FLOPs multiplier for recomputed forwards; "
                                                      "megazero's profile counts one forward"),
    # ---- pipeline ------------------------------------------------------------------------------
    "pipeline.stages": _no_effect(_PIPELINE_MODULE),
    "pipeline.partition": _no_effect(_PIPELINE_MODULE),
    "pipeline.seed_layers": _no_effect(_PIPELINE_MODULE),
    "pipeline.activation_checkpoint_interval": _no_effect(_PIPELINE_MODULE),
    "pipeline.pipe_partitioned": _no_effect(_PIPELINE_MODULE),
    "pipeline.grad_partitioned": _no_effect(_PIPELINE_MODULE),
    # ---- zero_optimization ---------------------------------------------------------------------
    "zero_optimization.cpu_offload_use_pin_memory": _no_effect("deprecated (DeepSpeed ignores it too); see "
                                                               "offload_optimizer.pin_memory"),
    "zero_optimization.allgather_sequential": _no_effect(_NCCL),
    "zero_optimization.stage3_allgather_sequential": _no_effect(_NCCL),
    "zero_optimization.use_all_reduce_for_fetch_params": _no_effect(_NCCL),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": _no_effect(_NCCL),
    "zero_optimization.use_multi_rank_bucket_allreduce": _no_effect(_NCCL),
    "zero_optimization.max_live_parameters": _no_effect(_STAGE3_CACHE),
    "zero_optimization.stage3_max_live_parameters": _no_effect(_STAGE3_CACHE),
    "zero_optimization.max_reuse_distance": _no_effect(_STAGE3_CACHE),
    "zero_optimization.stage3_max_reuse_distance": _no_effect(_STAGE3_CACHE),
    "zero_optimization.model_persistence_threshold": _no_effect(_STAGE3_CACHE),
    "zero_optimization.stage3_model_persistence_threshold": _no_effect(_STAGE3_CACHE),
    "zero_optimization.round_robin_gradients": _no_effect("a ZeRO-Offload gradient-placement knob for GPUs"),
    "zero_optimization.elastic_checkpoint": _no_effect(_LAYOUT_FREE),
    "zero_optimization.legacy_stage1": _no_effect("DeepSpeed's former stage-1 implementation"),
    "zero_optimization.load_from_fp32_weights": _refused(
        "initialising the fp32 masters from the 16-bit weights at load (megazero loads the saved masters)",
        _is(True), "true"),
    "zero_optimization.ignore_unused_parameters": _refused(
        "failing on parameters that get no gradient (megazero reduces them as zero)", _is(True), "true"),
    "zero_optimization.compute_grad_norm": _refused(
        "skipping the gradient norm (megazero takes it at every step for overflow and clipping)", _is(True), "true"),
    "zero_optimization.enable_sanity_checks": _no_effect("DeepSpeed's ZeRO-3 debugging checks"),
    "zero_optimization.log_trace_cache_warnings": _no_effect("DeepSpeed's ZeRO-3 trace-cache diagnostics"),
    "zero_optimization.memory_efficient_linear": _no_effect("DeepSpeed's ZeRO-3 linear layer; megazero's stage 3 "
                                                            "frees parameters by unit"),
    "zero_optimization.override_module_apply": _no_effect("DeepSpeed's ZeRO-3 module.apply hook"),
    "zero_optimization.parameter_alignment": _no_effect("a GPU alignment knob; megazero pads partitions itself"),
    "zero_optimization.pipeline_loading_checkpoint": _no_effect(_LAYOUT_FREE),
    "zero_optimization.save_muon_momentum_buffer_in_memory": _no_effect(
        "DeepSpeed's Muon under offload; megazero's Muon keeps its momentum with the masters and refuses optimizer "
        "offload"),
    "zero_optimization.leaf_module": _refused(
        "naming ZeRO-3 leaf modules (use stage3_module_granularity_threshold)",
        lambda v: v is None or (isinstance(v, dict) and not any(v.values())), "every list empty"),
    "zero_optimization.zenflow": _refused("ZenFlow (stall-free offloaded optimizer steps)", _is(None), "null"),
    "zero_optimization.zero_hpz_partition_size": _refused("ZeRO++ hierarchical partitioning (hpZ)", _is(1), "1"),
    "zero_optimization.zero_quantized_weights": _refused_unless_false("ZeRO++ quantized weights (qwZ)"),
    "zero_optimization.zero_quantized_nontrainable_weights": _refused_unless_false(
        "ZeRO++ quantized non-trainable weights"),
    "zero_optimization.zero_quantized_gradients": _refused_unless_false("ZeRO++ quantized gradients (qgZ)"),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": _no_effect("megazero's CPU Adam uses torch's threads"),
    "zero_optimization.offload_optimizer.pipeline_read": _no_effect("megazero overlaps NVMe reads by buffer_count"),
    "zero_optimization.offload_optimizer.pipeline_write": _no_effect("megazero overlaps NVMe writes by "
                                                                     "buffer_count"),
    "zero_optimization.offload_optimizer.super_offload": _refused_unless_false("SuperOffload"),
}
for _key in ("amp", "compression_training", "curriculum_learning", "eigenvalue", "elasticity", "graph_harvesting",
             "nebula", "progressive_layer_drop", "quantize_training", "sparse_attention", "sparse_gradients",
             "zero_optimization.mics_shard_size", "zero_optimization.mics_hierarchical_params_gather",
             "zero_optimization.zeropp_loco_param"):
    RULES[_key] = _refused(_REMOVED)

# DeepSpeed keys a block's validator reads without a field of their own (megazero.config.deprecated)
IMPLEMENTED_ELSEWHERE = {"zero_optimization.cpu_offload": "read as offload_optimizer (megazero.config.deprecated)",
                         "zero_optimization.cpu_offload_param": "read as offload_param (megazero.config.deprecated)"}
_OLD_SPELLINGS = {"bfloat16": "bf16"}  # DeepSpeed's older block names: the rules of the newer one apply


def canonical(path: str) -> str:
    """`path` with DeepSpeed's older block spelling replaced by the newer one."""
    head, _, rest = path.partition(".")
    new = _OLD_SPELLINGS.get(head)
    return (new + ("." + rest if rest else "")) if new else path


def rule_for(path: str) -> Rule | None:
    """The rule of `path` or of the nearest block above it that has one."""
    parts = canonical(path).split(".")
    for end in range(len(parts), 0, -1):
        rule = RULES.get(".".join(parts[:end]))
        if rule is not None:
            return rule
    return None


def schema_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every dotted key the schema `model` (megazero.config.EngineConfig) holds (aliases included;
    `optimizer.params` and `scheduler.params` are one key each: their keys depend on the type)."""
    keys = set()
    for name, info in model.model_fields.items():
        inner = section_type(info.annotation)
        for key in field_keys(name, info):
            keys.add(prefix + key)
            if inner is not None:
                keys |= schema_keys(inner, f"{prefix}{key}.")
    return keys


def classify(path: str, model: type[BaseModel]) -> str | None:
    """The class of DeepSpeed key `path` for megazero's schema `model`: IMPLEMENTED, NO_EFFECT or
    REFUSED (for a rule refusing unless off, REFUSED); None when megazero does not classify it."""
    keys = schema_keys(model)
    if path in keys or canonical(path) in keys or path in IMPLEMENTED_ELSEWHERE:
        return IMPLEMENTED
    rule = rule_for(path)
    return None if rule is None else (REFUSED if rule.refused else NO_EFFECT)


def committed_keys() -> dict:
    """The committed list of DeepSpeed's keys (configs/deepspeed_keys.json)."""
    with open(KEY_LIST) as f:
        return json.load(f)


def unknown_keys_warn() -> bool:
    """True when MEGAZERO_UNKNOWN_CONFIG_KEYS=warn: unknown keys are warnings, not errors."""
    value = os.environ.get(UNKNOWN_KEYS_ENV, "error").strip().lower()
    if value not in ("warn", "error", ""):
        raise ValueError(f"${UNKNOWN_KEYS_ENV}={value!r}: use 'warn' or 'error'")
    return value == "warn"


class UnknownKey(ValueError):
    """A config key neither megazero nor DeepSpeed defines (the message names it, with a suggestion)."""


class RefusedKey(ValueError):
    """A DeepSpeed key whose feature megazero lacks (the message names the feature)."""


def screen(raw: dict, model: type[BaseModel], loc: tuple = ()) -> dict:
    """`raw` with DeepSpeed's keys that have no effect here dropped (one warning each), after
    raising RefusedKey for one whose feature megazero lacks and UnknownKey for a key nobody
    defines (a warning, the key dropped, with MEGAZERO_UNKNOWN_CONFIG_KEYS=warn). Keys of
    megazero's schema (`model`, megazero.config.EngineConfig) are kept for it to validate."""
    names = key_names(model)
    out = {}
    for key, value in raw.items():
        path = loc + (key,)
        text = dotted(path)
        if key in names:
            field = next(info for name, info in model.model_fields.items() if key in field_keys(name, info))
            inner = section_type(field.annotation)
            if inner is not None and isinstance(value, dict):
                value = screen(value, inner, path)
            out[key] = value
        elif text in IMPLEMENTED_ELSEWHERE:
            out[key] = value
        elif (rule := RULES.get(canonical(text))) is not None:
            if rule.applies(value) == REFUSED:
                raise RefusedKey(f"'{text}' is DeepSpeed's key for {rule.why}, which megazero does not implement"
                                 + (f" (accepted without effect when {rule.off_text})" if rule.off_text else ""))
            why = f"its value leaves off {rule.why}, which megazero lacks" if rule.refused else rule.why
            warnings.warn(f"config key '{text}' has no effect in megazero: {why}", stacklevel=3)
        else:
            message = _unknown_message(text, key, names, loc)
            if not unknown_keys_warn():
                raise UnknownKey(message)
            warnings.warn(f"{message}; dropped (${UNKNOWN_KEYS_ENV}=warn)", stacklevel=3)
    return out


def _unknown_message(text: str, key: str, names: list[str], loc: tuple) -> str:
    prefix = canonical(dotted(loc)) + "." if loc else ""
    deepspeed_here = [k[len(prefix):] for k in RULES if k.startswith(prefix) and "." not in k[len(prefix):]]
    hint = suggest(key, names) or suggest(key, deepspeed_here)
    return (f"unknown key '{text}'{hint} (neither megazero nor DeepSpeed defines it; {UNKNOWN_KEYS_ENV}=warn in the "
            f"environment drops it with a warning); valid keys: {', '.join(sorted(names))}")
