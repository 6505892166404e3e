"""The optimizers the config's `optimizer.type` may name, keyed by lower-case type name.

Each entry pairs the display name with the pydantic model of its `optimizer.params`, which the
config validates against (so a new optimizer is one line here plus its params model).
"""

from __future__ import annotations

from dataclasses import dataclass

from megazero.optim.params import AdagradParams, AdamParams, AdamWParams, LambParams, SGDParams


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer type: its display name and its params model."""

    name: str
    params: type


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adam": OptimizerSpec("Adam", AdamParams),
    "adamw": OptimizerSpec("AdamW", AdamWParams),
    "sgd": OptimizerSpec("SGD", SGDParams),
    "lamb": OptimizerSpec("Lamb", LambParams),
    "adagrad": OptimizerSpec("Adagrad", AdagradParams),
}
