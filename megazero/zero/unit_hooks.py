"""When ZeRO-3 units are fetched and released: module and autograd hooks over a UnitFetcher.

- Forward: a unit is fetched just before its module's forward (and, once the first step has shown
  the order, the next unit's gather is started), and released after it. With grad enabled, a hook
  on each output tensor (in a list, tuple, dict or dataclass too) fetches it again when the
  gradient of that output arrives, just before its backward (and starts the previous unit's
  gather); it is released once every one of its parameters' gradients has been accumulated (they
  are then in the reduce buckets).
- Recomputation inside backward (activation checkpointing): the unit stays whole until its
  gradients are in.
- External use: a parameter read as `module.weight` while its unit is not whole, inside any forward
  of the model (a parent's functional use, such as GPT's output layer reading the tied word
  embedding, or a second module sharing the parameter), fetches its unit on the spot and holds it
  whole until its gradients are in (without grad: until the model's forward returns). The read is
  seen through each module's `_parameters` dict, which is replaced by a dict that checks this, as
  DeepSpeed does. Outside forwards nothing is fetched (code reading `.weight` then sees the empty
  tensor, as before; it uses GatheredParameters).
- A module called several times per forward is fetched for each call; its gradients arrive once
  all its uses' backward is done, and it stays whole in between.
- Saved tensors: inside a forward of the model, what autograd saves that views a gathered
  parameter buffer (`F.linear` saves `weight.t()`) is kept by position and rebuilt from the
  buffer gathered again for backward (`megazero.zero.saved_views`), so a release frees memory
  (not in a recomputation inside backward, whose saved tensors activation checkpointing keeps).
"""

from __future__ import annotations

import dataclasses

import torch

from megazero.zero.fetch import Unit
from megazero.zero.saved_views import saved_parameter_views


class _UnitParameters(dict):
    """A module's `_parameters`: reading a parameter inside a forward while its unit is not whole
    fetches the unit (see the module docstring)."""

    def __init__(self, original: dict, hooks: UnitHooks):
        super().__init__(original)
        self._hooks = hooks

    def __getitem__(self, name: str):
        param = super().__getitem__(name)
        unit = getattr(param, "_megazero_unit", None)
        if unit is not None and not unit.gathered and self._hooks.forward_depth > 0:
            self._hooks.fetch_external(unit)
        return param


class UnitHooks:
    """Installs the hooks on `model` (every module of it) for `units`, each fetched and released
    through its own fetcher (`unit.fetcher`: one per data-parallel state, so that the units of an
    expert-parallel model's two states share these hooks)."""

    def __init__(self, model: torch.nn.Module, units: list[Unit]):
        self.units = units
        self.forward_depth = 0  # module forwards of this model running now
        self._model = model
        self._saved_views = None  # the saved-tensor hooks, entered while a forward of the model runs
        for module in model.modules():
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._exit, always_call=True)
            if module._parameters:
                module.__dict__["_parameters"] = _UnitParameters(module._parameters, self)
        for unit in units:
            unit.module.register_forward_pre_hook(lambda mod, args, unit=unit: self._before_forward(unit))
            unit.module.register_forward_hook(lambda mod, args, out, unit=unit: self._after_forward(unit, out))
            for shard in unit.shards:
                for p in shard.layout.params:
                    p.register_post_accumulate_grad_hook(lambda p, unit=unit: self._grad_arrived(unit))

    def _enter(self, module, args) -> None:
        # not in a recomputation inside backward: activation checkpointing's own hooks must see
        # what the recomputed forward saves (and it is freed by the end of the segment's backward)
        if self.forward_depth == 0 and torch._C._current_autograd_node() is None:
            self._saved_views = saved_parameter_views()
            self._saved_views.__enter__()
        self.forward_depth += 1

    def _exit(self, module, args, output) -> None:
        self.forward_depth -= 1
        if self.forward_depth == 0 and self._saved_views is not None:
            self._saved_views.__exit__(None, None, None)
            self._saved_views = None
        if module is self._model and self.forward_depth == 0 and not torch.is_grad_enabled():
            for unit in self.units:  # no backward follows: free what external reads held
                if unit.held:
                    unit.fetcher.release(unit)

    def fetch_external(self, unit: Unit) -> None:
        """A parameter of `unit` is read outside the unit's forward: fetch and hold it."""
        unit.fetcher.fetch(unit)
        unit.held = True
        if torch.is_grad_enabled() and unit.grads_pending <= 0:
            unit.grads_pending = unit.num_params

    def _before_forward(self, unit: Unit) -> None:
        unit.fetcher.fetch(unit)
        unit.fetcher.record(unit)
        unit.fetcher.prefetch_next(unit, +1)  # the next unit's gather overlaps this one's forward

    def _before_backward(self, unit: Unit) -> None:
        unit.fetcher.fetch(unit)
        unit.fetcher.prefetch_next(unit, -1)  # backward runs the units in reverse

    def _after_forward(self, unit: Unit, output) -> None:
        if torch._C._current_autograd_node() is not None:
            # recomputation inside backward (activation checkpointing): whole until its gradients are in
            if unit.grads_pending <= 0:
                unit.grads_pending = unit.num_params
            return
        if not torch.is_grad_enabled():
            if not unit.held:
                unit.fetcher.release(unit)
            return
        unit.grads_pending = unit.num_params
        if unit.held:
            return  # read outside its forward too: whole until its gradients are in
        unit.fetcher.release(unit)
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, unit=unit: self._before_backward(unit))

    def _grad_arrived(self, unit: Unit) -> None:
        unit.grads_pending -= 1
        if unit.grads_pending == 0:
            unit.fetcher.release(unit)


def _tensors(output):
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):  # (e.g. the MoE router's Routing)
        for f in dataclasses.fields(output):
            yield from _tensors(getattr(output, f.name))
