"""Fuzz the config through its own JSON Schema: every field (nested blocks and each optimizer's and
schedule's params included), set to its default, to a wrong type and to an out-of-range value."""

from __future__ import annotations

import copy

import pytest

from megazero.config import ConfigError, EngineConfig, parse_config
from megazero.config.schema import json_schema
from megazero.config_fields import section_type
from megazero.optim.lr_schedules import SCHEDULERS
from megazero.optim.registry import OPTIMIZERS

SCHEMA = json_schema()
# valid on its own; a case changes one key of it
BASE = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8}


def _deref(node: dict) -> dict:
    if "$ref" in node:
        return {**SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[1]], **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def _value_schema(node: dict) -> dict:
    """The non-null alternative of a nullable leaf (`int | None`), or the node itself."""
    options = [o for o in node.get("anyOf", []) if o.get("type") != "null"]
    if len(options) == 1 and len(node["anyOf"]) == 2:
        return {**{k: v for k, v in node.items() if k != "anyOf"}, **options[0]}
    return node


def _valid(node: dict):
    """A valid value for a leaf without a default (a required schedule parameter)."""
    node = _value_schema(node)
    low = node.get("minimum", node.get("exclusiveMinimum", 0))
    return {"integer": int(low) + 1, "number": float(low) + 0.5, "boolean": True}[node["type"]]


def _wrong_types(node: dict) -> list:
    node = _value_schema(node)
    if "anyOf" in node:  # a number or one per param group
        return ["x", True, {"a": 1}]
    return {"integer": ["x", True, 1.5, [1]], "number": ["x", True, {"a": 1}],
            "boolean": [1, "true", None], "string": [5, True], "array": ["x", 0.9, [0.9], [0.9, 0.9, 0.9]],
            "object": [[], "x", 3]}[node.get("type", "object")]


def _out_of_range(node: dict) -> list:
    node = _value_schema(node)
    if "anyOf" in node:
        return [_out_of_range(o)[0] for o in node["anyOf"] if _out_of_range(o)]
    if "const" in node:
        return [not node["const"]]
    if "enum" in node:
        return [max(node["enum"]) + 1] if node.get("type") == "integer" else ["no-such-choice"]
    if "pattern" in node:
        return ["no-such-choice"]
    if node.get("type") == "array" and "prefixItems" in node:
        first = _out_of_range(node["prefixItems"][0])
        return [[v, 0.5] for v in first]
    if node.get("type") == "array":
        return [[v] for v in _out_of_range(node["items"])]
    step = 1 if node.get("type") == "integer" else 0.5
    values = []
    if "minimum" in node:
        values.append(node["minimum"] - step)
    if "exclusiveMinimum" in node:
        values.append(node["exclusiveMinimum"])
    if "maximum" in node:
        values.append(node["maximum"] + step)
    if "exclusiveMaximum" in node:
        values.append(node["exclusiveMaximum"])
    return values


def _leaves(obj: dict, path: tuple) -> list[tuple[tuple, dict, bool]]:
    """(path, schema, required) of every key below `obj`, blocks included (they take wrong types too)."""
    found = []
    for name, prop in obj.get("properties", {}).items():
        if name == "bfloat16":  # the old spelling of bf16: the same block
            continue
        node = _deref(prop)
        found.append((path + (name,), node, name in obj.get("required", [])))
        if node.get("type") == "object" and "properties" in node:
            found += _leaves(node, path + (name,))
    return found


def _with(config: dict, path: tuple, value) -> dict:
    config = copy.deepcopy(config)
    block = config
    for key in path[:-1]:
        block = block.setdefault(key, {})
    block[path[-1]] = value
    return config


def _typed_params(section: str) -> list[tuple[str, dict]]:
    """(type name, params model schema) for each type of `section` ("optimizer" or "scheduler")."""
    definition = _deref(SCHEMA["properties"][section])
    kind = definition["properties"]["type"]
    names = kind.get("enum", kind.get("examples"))
    return [(name, _deref(clause["then"]["properties"]["params"])) for name, clause in zip(names, definition["allOf"])]


def _cases():
    """(id, base config, path, schema, required) for every field the schema describes."""
    cases = [(".".join(path), BASE, path, node, required) for path, node, required in _leaves(SCHEMA, ())]
    for section in ("optimizer", "scheduler"):
        for name, model in _typed_params(section):
            required = {key: _valid(model["properties"][key]) for key in model.get("required", [])}
            base = {**BASE, section: {"type": name, "params": required}}
            for path, node, is_required in _leaves(model, (section, "params")):
                cases.append((f"{name}:{'.'.join(path)}", base, path, node, is_required))
    return cases


CASES = _cases()


def _dotted(path: tuple) -> str:
    return ".".join(path)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_default_is_valid_and_bad_values_name_the_key(case):
    _, base, path, node, required = case
    value = _valid(node) if required else node.get("default", {} if node.get("type") == "object" else None)
    parse_config(_with(base, path, value), 1)  # its default (or a valid value) changes nothing
    bad = [("wrong type", v) for v in _wrong_types(node)] + [("out of range", v) for v in _out_of_range(node)]
    assert bad, f"no bad value for {_dotted(path)}: {node}"
    for why, value in bad:
        with pytest.raises(ConfigError) as info:
            parse_config(_with(base, path, value), 1)
        message = str(info.value)
        assert f"'{_dotted(path)}" in message, f"{why} {value!r}: {message}"
        assert "\n" not in message


def _model_paths(model, prefix: tuple) -> set[tuple]:
    paths = set()
    for name, info in model.model_fields.items():
        paths.add(prefix + (name,))
        inner = section_type(info.annotation)
        if inner is not None:
            paths |= _model_paths(inner, prefix + (name,))
    return paths


def test_fuzz_covers_every_field_of_every_model():
    """The walk reaches every key of the pydantic models: the schema leaves none out."""
    expected = {(None,) + p for p in _model_paths(EngineConfig, ())}
    for spec in OPTIMIZERS.values():
        expected |= {(spec.name,) + p for p in _model_paths(spec.params, ("optimizer", "params"))}
    for name, cls in SCHEDULERS.items():
        expected |= {(name,) + p for p in _model_paths(cls.params_model, ("scheduler", "params"))}
    walked = {((c[0].split(":")[0] if ":" in c[0] else None),) + c[2] for c in CASES}
    assert walked == expected
    out_of_range = [c[0] for c in CASES if _out_of_range(c[3])]
    assert len(out_of_range) > 60, out_of_range  # most keys have bounds or choices
