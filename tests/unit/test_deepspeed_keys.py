"""Every config key DeepSpeed 0.19 defines has a class in megazero's schema (implemented, accepted
without effect, refused with the missing feature named), and a key nobody defines stays an error."""

from __future__ import annotations

import copy
import importlib.util
import json
import warnings

import pytest
import torch

from megazero.config import ConfigError, EngineConfig, parse_config
from megazero.config.deepspeed_keys import (
    IMPLEMENTED,
    NO_EFFECT,
    REFUSED,
    RULES,
    UNKNOWN_KEYS_ENV,
    classify,
    committed_keys,
)
from megazero.config.schema import docs_table

BASE = {"train_batch_size": 8}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

# DeepSpeedExamples training/cifar/cifar10_deepspeed.py's config dict, verbatim
CIFAR = {"train_batch_size": 16, "steps_per_print": 2000, "optimizer": {"type": "Adam", "params": {
    "lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}}, "scheduler": {
    "type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0, "prescale_gradients": False, "bf16": {"enabled": True}, "fp16": {
    "enabled": False, "fp16_master_weights_and_grads": False, "loss_scale": 0, "loss_scale_window": 500,
    "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15}, "wall_clock_breakdown": False,
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "reduce_scatter": True,
                          "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000, "overlap_comm": True,
                          "contiguous_gradients": True, "cpu_offload": False}}


def _deepspeed_keys() -> list[str]:
    """DeepSpeed's keys: walked from the installed DeepSpeed, else the committed list."""
    if HAS_DEEPSPEED:
        from megazero.config.deepspeed_walk import walk

        found = walk()
    else:
        found = committed_keys()
    return found["keys"] + found["removed"]


def _error(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, **raw}, 1)
    return str(info.value)


def test_every_deepspeed_key_has_a_class():
    keys = _deepspeed_keys()
    assert len(keys) > 300 and "zero_optimization.allgather_bucket_size" in keys
    assert [k for k in keys if classify(k, EngineConfig) is None] == []


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (the bench extra)")
def test_the_committed_list_is_the_installed_deepspeeds():
    from megazero.config.deepspeed_walk import walk

    found, committed = walk(), committed_keys()
    if found["deepspeed"] != committed["deepspeed"]:
        pytest.skip(f"DeepSpeed {found['deepspeed']} installed, the list is of {committed['deepspeed']}")
    assert found == committed, "run: python -m megazero.config deepspeed-keys --write configs/deepspeed_keys.json"


def test_the_classes_are_all_used_and_the_rules_name_deepspeed_keys():
    committed = set(committed_keys()["keys"]) | set(committed_keys()["removed"])
    assert {classify(k, EngineConfig) for k in committed} == {IMPLEMENTED, NO_EFFECT, REFUSED}
    assert [path for path in RULES if path not in committed] == []


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_cifar_tutorials_config_loads(stage):
    raw = copy.deepcopy(CIFAR)
    raw["zero_optimization"]["stage"] = stage
    with pytest.warns(UserWarning, match="'zero_optimization.cpu_offload' is deprecated"):
        config = parse_config(raw, 2)
    assert (config.bf16.enabled, config.train_micro_batch_size_per_gpu, config.zero_optimization.stage) == \
        (True, 8, stage)
    assert config.zero_optimization.allgather_bucket_size == 50_000_000
    assert config.zero_optimization.offload_optimizer.device == "none"


def test_deepspeed_keys_in_its_examples_load():
    config = parse_config({**BASE, "prescale_gradients": True, "gradient_predivide_factor": 2.0,
                           "zero_allow_untested_optimizer": True, "fp16": {"enabled": True, "auto_cast": True},
                           "optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, 1)
    assert (config.zero_optimization.prescale_gradients, config.zero_optimization.gradient_predivide_factor) == \
        (True, 2.0)
    assert config.fp16.auto_cast and config.zero_allow_untested_optimizer
    assert config.optimizer.params == {"bias_correction": False}


@pytest.mark.parametrize("raw, feature", [
    ({"data_efficiency": {"enabled": True}}, "curriculum learning and data sampling"),
    ({"zero_optimization": {"zero_quantized_weights": True}}, "ZeRO++ quantized weights"),
    ({"torch_autocast": {"enabled": True}}, "torch.autocast"),
    ({"elasticity": {"enabled": False}}, "removed from DeepSpeed itself"),
    ({"fp16": {"fp16_master_weights_and_grads": True}}, "fp16 master weights and gradients"),
    ({"optimizer": {"type": "MuAdam"}}, "muP optimizer (maximal update parametrization), not implemented"),
])
def test_refused_keys_name_the_missing_feature(raw, feature):
    message = _error(raw)
    assert feature in message and "unknown key" not in message


@pytest.mark.parametrize("raw, key", [
    ({"data_efficiency": {"enabled": False, "data_sampling": {"num_workers": 2}}}, "data_efficiency"),
    ({"zero_optimization": {"stage3_max_live_parameters": 10}}, "zero_optimization.stage3_max_live_parameters"),
    ({"bfloat16": {"enabled": True, "immediate_grad_update": True}}, "bfloat16.immediate_grad_update"),
    ({"zero_optimization": {"zero_quantized_weights": False}}, "zero_optimization.zero_quantized_weights"),
    ({"optimizer": {"type": "Adam", "legacy_fusion": False}}, "optimizer.legacy_fusion"),
])
def test_keys_without_effect_warn_once_naming_the_key(raw, key):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse_config({**BASE, **raw}, 1)
    named = [str(w.message) for w in caught if f"'{key}' has no effect" in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in caught]


def test_other_spellings_and_deprecated_switches():
    config = parse_config({**BASE, "zero_optimization": {"stage": 3, "prefetch_bucket_size": 7,
                                                         "param_persistence_threshold": 3},
                           "aio": {"intra_op_parallelism": 2}}, 1)
    zero = config.zero_optimization
    assert (zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold) == (7, 3)
    assert config.aio.thread_count == 2
    assert "two spellings of one key" in _error({"zero_optimization": {"prefetch_bucket_size": 7,
                                                                       "stage3_prefetch_bucket_size": 7}})
    with pytest.warns(UserWarning, match="cpu_offload' is deprecated"):
        config = parse_config({**BASE, "zero_optimization": {"stage": 2, "cpu_offload": True}}, 1)
    assert config.zero_optimization.offload_optimizer.device == "cpu"


def test_a_key_nobody_defines_is_an_error_with_a_suggestion():
    assert "unknown key 'prescale_gradient' (did you mean 'prescale_gradients'?)" in _error(
        {"prescale_gradient": True})
    assert "unknown key 'zero_optimization.allgather_bucket' (did you mean 'allgather_bucket_size'?)" in _error(
        {"zero_optimization": {"allgather_bucket": 5}})
    assert f"{UNKNOWN_KEYS_ENV}=warn in the environment drops it" in _error({"cuda_visible_devices": 0})


@pytest.mark.parametrize("optimizer, params", [
    ("OnebitAdam", {"freeze_step": 23000, "cuda_aware": False, "comm_backend_name": "nccl"}),
    ("ZeroOneAdam", {"bias_correction": False, "var_freeze_step": 1000, "var_update_scaler": 16,
                     "local_step_scaler": 1000, "local_step_clipper": 16, "cuda_aware": True,
                     "comm_backend_name": "nccl"}),
    ("OneBitLamb", {"freeze_step": 1000, "max_coeff": 0.3, "min_coeff": 0.01, "coeff_beta": 0.9, "factor_max": 4.0,
                    "factor_min": 0.5, "factor_threshold": 0.1, "cuda_aware": False, "comm_backend_name": "mpi"}),
])
def test_the_one_bit_optimizers_take_deepspeeds_params(optimizer, params):
    """DeepSpeedExamples' own params (BingBert, the 0/1 Adam tutorial); the backend keys warn once each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = parse_config({**BASE, "optimizer": {"type": optimizer, "params": {"lr": 1e-4, **params}}}, 1)
    assert config.optimizer.params["lr"] == 1e-4
    for key in ("cuda_aware", "comm_backend_name"):
        assert sum(f"'optimizer.params.{key}' has no effect" in str(w.message) for w in caught) == 1
    with pytest.raises(ConfigError, match="freeze_st"):
        parse_config({**BASE, "optimizer": {"type": optimizer, "params": {"freeze_stepp": 3}}}, 1)


def test_the_switch_makes_unknown_keys_warnings(monkeypatch):
    monkeypatch.setenv(UNKNOWN_KEYS_ENV, "warn")
    with pytest.warns(UserWarning, match="unknown key 'cuda_visible_devices'.*dropped"):
        config = parse_config({**BASE, "cuda_visible_devices": 0}, 1)
    assert config.train_batch_size == 8
    assert "refused" not in json.dumps(config.model_dump())
    assert "curriculum" in _error({"data_efficiency": {"enabled": True}})  # refusals stay errors
    monkeypatch.setenv(UNKNOWN_KEYS_ENV, "sometimes")
    with pytest.raises(ValueError, match="MEGAZERO_UNKNOWN_CONFIG_KEYS"):
        parse_config({**BASE, "cuda_visible_devices": 0}, 1)


def test_the_docs_table_has_a_class_for_every_key():
    table = docs_table().split("`optimizer.params` by `optimizer.type`")[0]
    rows = [line for line in table.splitlines() if line.startswith("| `") or line.startswith("| **`")]
    classes = {row.split(" | ")[1] for row in rows}
    assert {c.split(" (")[0] for c in classes} == {IMPLEMENTED, NO_EFFECT, REFUSED, "megazero only"}
    assert "| `prescale_gradients` | implemented |" in table
    assert '| `data_efficiency` | refused (no effect when "enabled": false) |' in table
    assert "| `seed` | megazero only |" in table


def test_clipping_in_optimizer_params_is_refused_with_the_key_to_use():
    """Six of DeepSpeedExamples' configs carry it: DeepSpeed's parser passes it, its engine refuses it."""
    with pytest.raises(ConfigError, match="'optimizer.params.max_grad_norm' is not an optimizer parameter.*"
                                          "'gradient_clipping'"):
        parse_config({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, 1)


def test_reduce_scatter_false_is_accepted_without_effect():
    with pytest.warns(UserWarning, match="'zero_optimization.reduce_scatter' false has no effect"):
        config = parse_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "reduce_scatter": False}}, 1)
    assert config.zero_optimization.reduce_scatter is True


def test_add_config_arguments_gives_deepspeeds_attributes(tmp_path):
    """A DeepSpeed script reads args.deepspeed_config (e.g. to json.load it) and args.deepspeed; any of
    DeepSpeed's spellings fills them; initialize() refuses a file in args beside a config= dict."""
    import argparse

    import megazero

    for spelling in ("--deepspeed_config", "--megazero_config", "--deepscale_config"):
        args = megazero.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed", spelling, "c.json"])
        assert (args.deepspeed_config, args.deepspeed) == ("c.json", True)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_batch_size": 8}))
    args = argparse.Namespace(deepspeed_config=str(path))
    with pytest.raises(ConfigError, match="two engine configs: --deepspeed_config .*c.json in args and config="):
        megazero.initialize(args=args, model=torch.nn.Linear(2, 2), config={"train_batch_size": 8})
