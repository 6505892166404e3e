"""The config schema: per-type params, the messages, and the generated files (JSON Schema, the key table of
docs/engine.md)."""

from __future__ import annotations

import glob
import inspect
import json
import os
import subprocess
import sys

import pytest

from megazero.config import ConfigError, parse_config
from megazero.config.schema import DOCS_BEGIN, DOCS_END, DOCS_PAGE, docs_table, json_schema, schema_text
from megazero.optim.lr_schedules import SCHEDULERS
from megazero.optim.registry import OPTIMIZERS

REPO = os.path.join(os.path.dirname(__file__), "..", "..")
BASE = {"train_batch_size": 8}


def _error(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, **raw}, 1)
    return str(info.value)


@pytest.mark.parametrize("raw, message", [
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}},
     "'optimizer.params.betas' must be a list of 2 numbers [beta1, beta2], got list [0.9]"),
    ({"optimizer": {"type": "Lamb", "params": {"betas": [0.9, 1.0]}}},
     "'optimizer.params.betas[1]' must be < 1.0, got 1.0"),
    ({"optimizer": {"type": "sgd", "params": {"momentum": "0.9"}}},
     "'optimizer.params.momentum' must be float, got str '0.9'"),
    ({"optimizer": {"type": "SGD", "params": {"nesterov": True, "momentum": 0.9, "dampening": 0.1}}},
     "'optimizer.params.nesterov' true needs 'optimizer.params.momentum' > 0 and 'optimizer.params.dampening' 0"),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": False, "amsgrad": True}}},
     "'optimizer.params.bias_correction' false with 'optimizer.params.amsgrad' true is not supported"),
    ({"optimizer": {"type": "Adagrad", "params": {"betas": [0.9, 0.9]}}}, "unknown key 'optimizer.params.betas'"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -5}}},
     "'scheduler.params.warmup_num_steps' must be >= 1, got -5"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
     "'scheduler.params.warmup_type' must be 'log' or 'linear', got 'cosine'"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, -0.1]}}},
     "'scheduler.params.warmup_max_lr' must be >= 0, got -0.1 in [0.1, -0.1]"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}},
     "'scheduler.params.cycle_min_lr' is required"),
    ({"zero_optimization": {"stage": 1.5}}, "'zero_optimization.stage' must be int, got float 1.5"),
    ({"zero_optimization": []}, "'zero_optimization' must be an object, got list []"),
    ({"activation_checkpointing": {"contiguous_memory_optimization": True, "partition_activations": True}},
     "'activation_checkpointing.contiguous_memory_optimization' needs 'activation_checkpointing.number_checkpoints'"),
    ({"bfloat16": {"enabled": 1}}, "'bfloat16.enabled' must be bool, got int 1"),
    ({"seed": 2**32}, "'seed' must be < 4294967296, got 4294967296"),
])
def test_messages_name_the_full_key_path_and_the_value(raw, message):
    text = _error(raw)
    assert message in text and "\n" not in text


def test_optimizer_params_keep_only_the_keys_given():
    """The builder sees the user's keys (coerced), so its own defaults still apply to the rest."""
    config = parse_config({**BASE, "optimizer": {"type": "adamw", "params": {"lr": 1, "betas": [0.9, 0.95]}}}, 1)
    assert config.optimizer.type == "adamw"
    assert config.optimizer.params == {"lr": 1.0, "betas": (0.9, 0.95)}
    assert type(config.optimizer.params["lr"]) is float
    config = parse_config({**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5e1}}}, 1)
    assert config.scheduler.params == {"warmup_num_steps": 50}
    assert type(config.scheduler.params["warmup_num_steps"]) is int


def test_null_blocks_are_their_defaults_as_before():
    config = parse_config({**BASE, "fp16": None, "optimizer": None}, 1)
    assert config.fp16.loss_scale_window == 1000 and config.optimizer.type == "AdamW" and config.optimizer.params == {}
    config = parse_config(BASE, 1)
    assert config.optimizer is None and config.scheduler is None and config.activation_checkpointing is None


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_params_models_match_the_signatures(name):
    """Each schedule's params model accepts exactly its constructor's keys, with the same defaults."""
    signature = inspect.signature(SCHEDULERS[name].__init__)
    accepted = {k: p for k, p in signature.parameters.items() if k not in ("self", "optimizer", "last_batch_iteration")}
    fields = SCHEDULERS[name].params_model.model_fields
    assert set(fields) == set(accepted)
    for key, parameter in accepted.items():
        if parameter.default is inspect.Parameter.empty:
            assert fields[key].is_required(), key
        else:
            assert fields[key].default == parameter.default, key


def test_every_engine_config_file_parses():
    paths = sorted(glob.glob(os.path.join(REPO, "configs", "ds_*.json")))
    assert len(paths) >= 4
    for path in paths:
        config = parse_config(path, 1)
        assert config.optimizer is not None, path


def test_the_schema_has_params_per_type():
    schema = json_schema()
    defs = schema["$defs"]
    optimizer_refs = [c["then"]["properties"]["params"]["$ref"] for c in defs["OptimizerConfig"]["allOf"]]
    assert optimizer_refs[:-1] == [f"#/$defs/{spec.params.__name__}" for spec in OPTIMIZERS.values()]
    assert optimizer_refs[-1] == "#/$defs/AdamWParams"  # no type: AdamW, the default
    scheduler_refs = [c["then"]["properties"]["params"]["$ref"] for c in defs["SchedulerConfig"]["allOf"]]
    assert scheduler_refs[:-1] == [f"#/$defs/{cls.params_model.__name__}" for cls in SCHEDULERS.values()]
    assert defs["AdamWParams"]["properties"]["betas"]["minItems"] == 2
    assert defs["ZeroConfig"]["properties"]["stage"]["enum"] == [0, 1, 2, 3]
    assert defs["FP16Config"]["properties"]["hysteresis"]["minimum"] == 1
    assert "bfloat16" in schema["properties"] and schema["additionalProperties"] is False


def test_committed_schema_is_current():
    with open(os.path.join(REPO, "configs", "megazero.schema.json")) as f:
        committed = f.read()
    assert committed == schema_text(), (
        "configs/megazero.schema.json is out of date: run `python -m megazero.config schema > "
        "configs/megazero.schema.json`")


def test_docs_key_table_is_current():
    with open(os.path.join(REPO, DOCS_PAGE)) as f:
        text = f.read()
    start, end = text.find(DOCS_BEGIN), text.find(DOCS_END)
    assert 0 <= start < end, f"{DOCS_PAGE} lost its config-keys markers"
    assert text[start:end + len(DOCS_END) + 1] == docs_table(), (
        f"{DOCS_PAGE}'s config-key table is out of date: run "
        f"`python -m megazero.config docs-table --write {DOCS_PAGE}`")


def test_the_nvme_example_offloads_parameters_and_optimizer():
    """configs/ds_zero3_offload_nvme.json is what its name says: stage 3, both offloads on NVMe."""
    zero = parse_config(os.path.join(REPO, "configs", "ds_zero3_offload_nvme.json"), 1).zero_optimization
    assert zero.stage == 3
    assert zero.offload_param.device == "nvme" and zero.offload_optimizer.device == "nvme"


def test_overlap_comm_is_true_at_every_stage():
    """megazero's default, unlike DeepSpeed's (true at stage 3 only): the key's description and
    docs/engine.md say why, and stay true to it."""
    for stage in range(4):
        assert parse_config({**BASE, "zero_optimization": {"stage": stage}}, 1).zero_optimization.overlap_comm
    description = json_schema()["$defs"]["ZeroConfig"]["properties"]["overlap_comm"]["description"]
    assert "DeepSpeed" in description


def test_the_command_line_prints_the_schema():
    result = subprocess.run([sys.executable, "-m", "megazero.config", "schema"], capture_output=True, text=True,
                            cwd=REPO, check=True)
    assert json.loads(result.stdout) == json_schema() and result.stderr == ""
