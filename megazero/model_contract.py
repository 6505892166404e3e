"""What the engine and the checkpoint code may ask of a model: one small protocol.

A model split by tensor or pipeline parallelism (models/gpt.py, models/bert.py; see
models/README.md) answers three questions the library cannot work out from an nn.Module alone:

- `global_parameter_name(name)`: a pipeline stage numbers its layers from 0; checkpoints hold
  every parameter under its name in the whole model (blocks.0 of the stage holding layers 4-7
  is blocks.4), so that any layout can load them.
- `tied_parameters()`: parameters with a copy on another pipeline stage (the word embedding,
  tied to the output layer, on the first and the last stage). The engine sums the copies'
  gradients over the grid's embedding group, ZeRO gives each its own partition layout, and
  the gradient norm counts them on the first stage only.
- `total_parameters()`: the whole model's parameter count (all shards and stages, a tied
  parameter once), which no single rank holds.

Any other module (a DeepSpeed user's) need not implement it: each question then has the answer
that fits a model in one piece (names as they are, nothing tied, the module's own parameters).
The helpers below are how the library asks, so it never probes for attributes itself.

A pipeline stage is also called in one agreed way (megazero.engine): every stage gets the
micro-batch's keyword arguments, the first as they are and each later one with the previous
stage's output added under HIDDEN_STATES; a stage before the last returns the tensor to send
on, the last returns the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

HIDDEN_STATES = "hidden_states"  # the keyword under which a pipeline stage receives its input


@runtime_checkable
class ModelContract(Protocol):
    """What a model parallelised by tensor or pipeline stages tells the engine and checkpoints."""

    def global_parameter_name(self, name: str) -> str:
        """This module's parameter `name` as named in the whole (unsplit) model."""
        ...

    def tied_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters with a copy on another pipeline stage, whose gradients are summed with it."""
        ...

    def total_parameters(self) -> int:
        """Parameters of the whole model: every shard and stage, a tied parameter counted once."""
        ...


def implements_contract(module: torch.nn.Module) -> bool:
    """True when `module` answers the ModelContract itself."""
    return isinstance(module, ModelContract)


EXPERT_ATTRIBUTE = "megazero_expert"  # set True on a parameter that holds this rank's experts (megazero.moe)


def is_expert_parameter(param: torch.nn.Parameter) -> bool:
    """True for a parameter that holds this rank's experts: data parallelism reduces it over the
    expert-data-parallel group, not the data-parallel one."""
    return bool(getattr(param, EXPERT_ATTRIBUTE, False))


def _same(name: str) -> str:
    return name


def global_name_of(module: torch.nn.Module) -> Callable[[str], str]:
    """The function taking the module's parameter names to the whole model's (identity without
    the contract)."""
    return module.global_parameter_name if implements_contract(module) else _same


def tied_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The module's tied parameters (none without the contract)."""
    return list(module.tied_parameters()) if implements_contract(module) else []


def total_parameters(module: torch.nn.Module) -> int:
    """Parameters of the whole model (without the contract: the module's own, shared ones once)."""
    if implements_contract(module):
        return module.total_parameters()
    return sum(p.numel() for p in module.parameters())


def model_config_dict(module: torch.nn.Module) -> dict | None:
    """The module's config as a plain dict for checkpoints, or None. Any `config` with a to_dict()
    counts (megazero's models, and Hugging Face's), as it always has: not part of the contract."""
    config = getattr(module, "config", None)
    return config.to_dict() if hasattr(config, "to_dict") else None
