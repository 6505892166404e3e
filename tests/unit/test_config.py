"""Config validation: the batch triad, unknown keys, types and ranges."""

from __future__ import annotations

import json
import os

import pytest

from megazero.config import ConfigError, parse_config, resolve_batch_triad


@pytest.mark.parametrize("given, dp, expected", [
    ((32, 4, 2), 4, (32, 4, 2)),
    ((32, 4, None), 4, (32, 4, 2)),
    ((32, None, 2), 4, (32, 4, 2)),
    ((None, 4, 2), 4, (32, 4, 2)),
    ((32, None, None), 4, (32, 8, 1)),
    ((None, 4, None), 4, (16, 4, 1)),
    ((8, 8, None), 1, (8, 8, 1)),
])
def test_batch_triad(given, dp, expected):
    assert resolve_batch_triad(*given, dp) == expected


def test_inconsistent_triad_shows_the_arithmetic():
    with pytest.raises(ConfigError, match=r"train_batch_size 30 != .* 4 x .* 2 x data-parallel size 4 = 32"):
        resolve_batch_triad(30, 4, 2, 4)


def test_indivisible_batch_is_an_error():
    with pytest.raises(ConfigError, match="not divisible"):
        resolve_batch_triad(30, 4, None, 4)
    with pytest.raises(ConfigError, match="set 'train_batch_size' or"):
        resolve_batch_triad(None, None, 2, 1)
    with pytest.raises(ConfigError, match="must be >= 1"):
        resolve_batch_triad(0, None, None, 1)


def test_data_parallel_size_is_used():
    config = parse_config({"train_batch_size": 16, "gradient_accumulation_steps": 2}, data_parallel_size=4)
    assert (config.train_micro_batch_size_per_gpu, config.data_parallel_size) == (2, 4)


@pytest.mark.parametrize("raw, message", [
    ({"train_batch_size": 8, "gradient_clippin": 1.0},
     "unknown key 'gradient_clippin' (did you mean 'gradient_clipping'?)"),
    ({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale_windo": 10}},
     "unknown key 'fp16.loss_scale_windo' (did you mean 'loss_scale_window'?)"),
    ({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "beta": [0.9, 0.9]}}},
     "unknown key 'optimizer.params.beta' (did you mean 'betas'?)"),
    ({"train_batch_size": 8, "optimizer": {"type": "Adamw2"}}, "'optimizer.type' 'Adamw2' is not supported"),
    ({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}},
     "unknown key 'scheduler.params.warmup_num_step' (did you mean 'warmup_num_steps'?)"),
    ({"train_batch_size": 8, "scheduler": {"type": "Cosine"}}, "'scheduler.type' 'Cosine' is not a known scheduler"),
    ({"train_batch_size": "8"}, "'train_batch_size' must be int, got str '8'"),
    ({"train_batch_size": 8, "fp16": {"enabled": "yes"}}, "'fp16.enabled' must be bool"),
    ({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true"),
    ({"train_batch_size": 8, "gradient_clipping": -1}, "'gradient_clipping' must be >= 0"),
    ({"train_batch_size": 8, "fp16": {"hysteresis": 0}}, "'fp16.hysteresis' must be >= 1"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 4}}, "'zero_optimization.stage' must be 0, 1, 2 or 3"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 2, "contiguous_gradients": False}},
     "'zero_optimization.contiguous_gradients' false is not supported"),
    ({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": -1.0}}},
     "'optimizer.params.lr' must be >= 0"),
])
def test_bad_config_names_the_key(raw, message):
    with pytest.raises(ConfigError) as info:
        parse_config(raw, 1)
    assert message in str(info.value)


def test_defaults_follow_deepspeed():
    config = parse_config({"train_batch_size": 8, "fp16": {"enabled": True}}, 1)
    assert config.fp16.initial_scale_power == 16 and config.fp16.loss_scale_window == 1000
    assert config.fp16.hysteresis == 2 and config.fp16.min_loss_scale == 1.0 and config.fp16.loss_scale == 0
    assert config.gradient_clipping == 0.0 and config.steps_per_print == 10
    assert config.zero_optimization.stage == 0 and config.zero_optimization.reduce_bucket_size == 500_000_000


def test_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                "zero_optimization": {"reduce_bucket_size": 5e7}}))
    config = parse_config(str(path), 2)
    assert config.train_batch_size == 4 and config.zero_optimization.reduce_bucket_size == 50_000_000
    with pytest.raises(ConfigError, match="not found"):
        parse_config(str(tmp_path / "missing.json"), 1)
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_config(str(tmp_path / "bad.json"), 1)


@pytest.mark.parametrize("order", ["bf16 first", "bfloat16 first"])
def test_bf16_and_bfloat16_disagreeing_is_an_error_in_either_order(order):
    blocks = [("bf16", {"enabled": True}), ("bfloat16", {"enabled": False})]
    raw = dict(blocks if order == "bf16 first" else blocks[::-1])
    with pytest.raises(ConfigError, match=r"'bf16' .* and 'bfloat16' .* disagree"):
        parse_config({"train_batch_size": 8, **raw}, 1)


def test_bf16_and_bfloat16_agreeing_is_one_block():
    config = parse_config({"train_batch_size": 8, "bfloat16": {"enabled": True}, "bf16": {"enabled": True}}, 1)
    assert config.bf16.enabled
    assert parse_config({"train_batch_size": 8, "bfloat16": {"enabled": True}}, 1).bf16.enabled


def test_recipe_precision_flag_replaces_either_spelling(tmp_path):
    """--bf16/--fp16 decide the precision even over an engine JSON with the old `bfloat16` block."""
    from megazero.config.cli import parse_run
    from megazero.config.run import RunConfig

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "bfloat16": {"enabled": False}}))
    for flag, expected in (("--bf16", (True, False)), ("--fp16", (False, True))):
        run = parse_run(RunConfig, ["--data-path", "unused", flag, "--deepspeed_config", str(path)], os.path.join(
                        os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "configs", "run_gpt2_cpu.json"))
        config = parse_config(run.engine, 1)
        assert (config.bf16.enabled, config.fp16.enabled) == expected


def _float_keys(model, prefix: str = "") -> list[tuple[str, bool]]:
    """(dotted key, takes a list) for every key of `model` whose value may hold a float (sections
    searched recursively)."""
    from megazero.config_fields import section_type

    keys = []
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        inner = section_type(info.annotation)
        if inner is not None:
            keys += _float_keys(inner, key + ".")
        elif "float" in repr(info.annotation):
            keys.append((key, repr(info.annotation).startswith("tuple[")))
    return keys


def _nested(dotted: str, value) -> dict:
    out = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def _merged(a: dict, b: dict) -> dict:
    return {**a, **{k: _merged(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                    for k, v in b.items()}}


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_no_float_key_takes_a_non_finite_value(bad):
    from megazero.config import EngineConfig
    from megazero.optim.lr_schedules import SCHEDULERS
    from megazero.optim.registry import OPTIMIZERS

    base = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    def value(pair: bool):  # a pair of floats (betas) gets the bad value second
        return [0.5, bad] if pair else bad

    cases = [(key, _nested(key, value(pair))) for key, pair in _float_keys(EngineConfig)]
    cases += [(f"optimizer.params.{key}", {"optimizer": {"type": name, "params": {key: value(pair)}}})
              for name, spec in OPTIMIZERS.items() for key, pair in _float_keys(spec.params)]
    def required(model) -> dict:  # what a schedule needs besides the key tried (valid: finite)
        return {k: 0.5 if "float" in repr(i.annotation) else 100 for k, i in model.model_fields.items()
                if i.is_required()}

    cases += [(f"scheduler.params.{key}", {"scheduler": {"type": name, "params": {
        **required(schedule.params_model), key: value(pair)}}})
        for name, schedule in SCHEDULERS.items() for key, pair in _float_keys(schedule.params_model)]
    assert len(cases) > 60  # fp16.loss_scale, optimizer.params.eps, scheduler.params.warmup_min_lr, ...
    accepted = []
    for key, override in cases:
        try:
            parse_config(_merged(base, override), 1)
            accepted.append(key)
        except ConfigError as e:
            # "must be a finite number", or a bound refused first ("must be >= 0, got -inf")
            assert f"'{key}" in str(e) and ("finite" in str(e) or f"got {bad}" in str(e)), (key, str(e))
    assert accepted == []
