"""Which modules are ZeRO-3 units: the modules whose parameters are fetched and released together.

As in DeepSpeed, every module that directly owns parameters is a unit of those parameters (its
`parameters(recurse=False)`), whatever its type: an element of an `nn.ModuleList`, a layer of an
`nn.Sequential`, a named attribute, the root itself. A parameter registered in several modules
(tied weights) belongs to the first of them in `model.modules()` order; the others reach it as an
external parameter (see `megazero.zero.unit_hooks`).

`stage3_module_granularity_threshold` (DeepSpeed's key and rule) merges small modules: a module's
granularity is its subtree's parameter elements divided by the modules in that subtree that would
each be a unit (torch leaf modules and non-container inner modules, itself included), and a module
whose granularity is at most the threshold becomes one unit of its whole subtree (its children get
no hooks of their own). Leaf modules and containers (ModuleList, Sequential, ...) are never merged
as a whole, since a container's forward may never run. 0 (the default) merges nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict, torch.nn.ParameterList,
               torch.nn.ParameterDict)
_NEVER = float("inf")


@dataclass
class UnitPlan:
    """One unit: `module` gets the fetch/release hooks; `params` are fetched with it."""

    module: torch.nn.Module
    params: list[torch.nn.Parameter] = field(default_factory=list)


def _granularities(module: torch.nn.Module, out: dict[int, float]) -> tuple[int, int]:
    """(unit-like modules, parameter elements) of `module`'s subtree; fills out[id(module)]."""
    out[id(module)] = _NEVER
    if not any(True for _ in module.parameters()):
        return 0, 0  # no parameters (GELU, dropout): not counted
    own = sum(p.numel() for p in module.parameters(recurse=False))
    children = list(module.children())
    if not children:
        return 1, own
    layers, numel = 0, own
    for child in children:
        child_layers, child_numel = _granularities(child, out)
        layers, numel = layers + child_layers, numel + child_numel
    if isinstance(module, _CONTAINERS):
        return layers, numel
    layers += 1
    out[id(module)] = numel // layers
    return layers, numel


def plan_units(model: torch.nn.Module, granularity_threshold: int = 0) -> list[UnitPlan]:
    """The units of `model`, in pre-order (`model.modules()` order: roughly the forward order)."""
    granularity: dict[int, float] = {}
    if granularity_threshold > 0:
        _granularities(model, granularity)
    plans: list[UnitPlan] = []
    assigned: set[int] = set()

    def take(params) -> list[torch.nn.Parameter]:
        mine = [p for p in params if id(p) not in assigned]
        assigned.update(id(p) for p in mine)
        return mine

    def visit(module: torch.nn.Module) -> None:
        if granularity.get(id(module), _NEVER) <= granularity_threshold:
            params = take(module.parameters())  # merged: the whole subtree is fetched as one unit
            if params:
                plans.append(UnitPlan(module, params))
            return
        params = take(module.parameters(recurse=False))
        if params:
            plans.append(UnitPlan(module, params))
        for child in module.children():
            visit(child)

    visit(model)
    return plans
