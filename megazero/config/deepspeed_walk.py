"""Every config key DeepSpeed defines, found by letting DeepSpeed's own config parser read a probe.

DeepSpeed reads its config in two ways: plain lookups (`get_scalar_param(d, "prescale_gradients",
False)`, `d.get("checkpoint", {})`, keys named by the constants modules) and pydantic models
(`DeepSpeedZeroConfig(**d["zero_optimization"])`). `walk()` runs
`DeepSpeedConfig._initialize_params` on a probe dict that records every key asked of it; blocks
it asks for are given back as probes too (one at a time, kept when DeepSpeed's parser still runs:
a key it reads as a scalar stays a scalar), so lookups nested in blocks are found; and each
pydantic model built from a probe is walked field by field (aliases, deprecated fields and nested
models included). A few keys DeepSpeed names outside that parser are added from its source:
`_EXTRA_KEYS` below, with where each is read.

Only the key names are kept. DeepSpeed is needed to run this (`python -m megazero.config
deepspeed-keys --write configs/deepspeed_keys.json`); the committed list serves without it.
"""

from __future__ import annotations

import json
import os
from typing import Any

_MARK = "\x00megazero-probe-path"  # carried into a pydantic model's kwargs to say which block built it

# keys DeepSpeed reads outside DeepSpeedConfig._initialize_params
_EXTRA_KEYS = (
    "sequence_parallel_size",  # deepspeed.initialize() and DeepSpeedConfig.__init__ (the mesh)
    "data_parallel_size",  # deepspeed.initialize() (the mesh, with sequence_parallel_size)
    "optimizer.params",  # runtime.config.get_optimizer_params, read once optimizer.type is given
    # the pipeline block's keys are the defaults dict of runtime.config.get_pipeline_config
    "pipeline.stages", "pipeline.partition", "pipeline.seed_layers", "pipeline.activation_checkpoint_interval",
    "pipeline.pipe_partitioned", "pipeline.grad_partitioned",
)
# DeepSpeed's older spelling of a block, read only when the newer one is absent
_OLD_SPELLINGS = {"bfloat16": "bf16"}


class _Probe(dict):
    """A config block that records every key DeepSpeed asks it for; the blocks of `present` below
    it are probes too, everything else is absent."""

    def __init__(self, path: str, walker: _Walker) -> None:
        super().__init__()
        self.path, self.walker = path, walker
        super().__setitem__(_MARK, path)
        depth = path.count(".") + 1 if path else 0
        for child in walker.present:
            if child.count(".") == depth and (not path or child.startswith(path + ".")):
                super().__setitem__(child.rsplit(".", 1)[-1], _Probe(child, walker))

    def _asked(self, key: Any) -> None:
        if isinstance(key, str) and key != _MARK:
            self.walker.seen.add(f"{self.path}.{key}" if self.path else key)

    def __contains__(self, key: Any) -> bool:
        self._asked(key)
        return super().__contains__(key)

    def __getitem__(self, key: Any) -> Any:
        self._asked(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._asked(key)
        return super().get(key, default)

    def keys(self) -> _Keys:
        return _Keys(self)

    def __iter__(self):  # also makes `**probe` go through keys(), carrying the mark into kwargs
        return (key for key in dict.keys(self) if key != _MARK)

    def items(self):
        return [(key, dict.__getitem__(self, key)) for key in self]


class _Keys:
    """`probe.keys()`: membership tests are lookups DeepSpeed makes (`if "aio" in d.keys()`)."""

    def __init__(self, probe: _Probe) -> None:
        self.probe = probe

    def __contains__(self, key: Any) -> bool:
        return key in self.probe

    def __iter__(self):
        return iter(list(dict.keys(self.probe)))  # the mark included: `**probe` must carry it

    def __len__(self) -> int:
        return len(dict.keys(self.probe))


class _Walker:
    """State of one walk: blocks given as probes, keys asked for, pydantic models per block path."""

    def __init__(self) -> None:
        self.present: set[str] = set()
        self.seen: set[str] = set()
        self.models: dict[str, type] = {}

    def parse(self) -> bool:
        """Run DeepSpeed's parser on the probe; True if it ran to the end."""
        from deepspeed.runtime import config as ds_config
        from deepspeed.runtime.config_utils import DeepSpeedConfigModel

        original = DeepSpeedConfigModel.__init__
        walker = self

        def recording_init(model: Any, strict: bool = False, **data: Any) -> None:
            path = data.pop(_MARK, None)
            if path is not None:
                walker.models[path] = type(model)
            for name, value in list(data.items()):
                if isinstance(value, _Probe):  # a block passed as one field of a model (the monitors)
                    walker.models[value.path] = type(model).model_fields[name].annotation
                    data[name] = {}
            original(model, strict=strict, **data)

        DeepSpeedConfigModel.__init__ = recording_init
        try:
            ds_config.DeepSpeedConfig._initialize_params(object.__new__(ds_config.DeepSpeedConfig), _Probe("", self))
            return True
        except Exception:  # a block read as a scalar: the caller takes it back
            return False
        finally:
            DeepSpeedConfigModel.__init__ = original


def _model_of(annotation: Any) -> type | None:
    import typing

    from pydantic import BaseModel

    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _model_keys(model: type, prefix: str) -> set[str]:
    """Every key `model` accepts below `prefix`: field names, aliases, nested models' keys."""
    keys = set()
    for name, info in model.model_fields.items():
        names = {name} | ({info.alias} if info.alias else set())
        inner = _model_of(info.annotation)
        for key in names:
            keys.add(f"{prefix}.{key}")
            if inner is not None:
                keys |= _model_keys(inner, f"{prefix}.{key}")
    return keys


def _removed_keys() -> set[str]:
    """Keys DeepSpeed names only to refuse them (features it has removed)."""
    from deepspeed.runtime import config as ds_config

    top = getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})
    zero = getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {})
    return set(top) | {f"zero_optimization.{key}" for key in zero}


def walk() -> dict:
    """{"deepspeed": version, "keys": every key DeepSpeed reads (dotted, sorted), "removed": keys it
    refuses as removed features}. Needs DeepSpeed importable (on CPU, DS_ACCELERATOR=cpu)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    walker = _Walker()
    if not walker.parse():
        raise RuntimeError("DeepSpeed's config parser fails on an empty config; cannot walk its keys")
    scalars: set[str] = set()
    while True:
        candidates = sorted(walker.seen - walker.present - scalars)
        if not candidates:
            break
        for path in candidates:
            walker.present.add(path)
            if not walker.parse():
                walker.present.discard(path)
                scalars.add(path)
        walker.parse()  # the models and keys of the blocks kept
    keys = set(walker.seen) | set(_EXTRA_KEYS)
    for path, model in walker.models.items():
        inner = _model_of(model)
        if inner is not None:
            keys |= _model_keys(inner, path)
    for old, new in _OLD_SPELLINGS.items():
        keys |= {old + key[len(new):] for key in keys if key == new or key.startswith(new + ".")}
    removed = _removed_keys()
    return {"deepspeed": deepspeed.__version__, "keys": sorted(keys - removed), "removed": sorted(removed)}


def walk_text() -> str:
    """walk() as the committed file holds it."""
    return json.dumps(walk(), indent=1) + "\n"
