"""Autograd must not keep a ZeRO-3 unit's gathered parameters alive from its forward to its backward.

`F.linear(x, w)` saves `w.t()` for backward: a view of the gathered flat buffer `w` points into,
not the parameter. Releasing the unit (`p.data = empty`) then frees nothing, since the view holds
the buffer, and every unit's whole parameters stay in memory from its forward until its backward:
the whole model at the peak, whatever stage 3 or parameter offload does. (DeepSpeed replaces
`F.linear` for this; here the hooks cover any op.) Inside a forward of the model, tensors autograd
saves that view a non-persistent partitioned parameter's buffer are stored as (shard, size,
stride, offset) and rebuilt on use from the buffer the unit is gathered into again for its
backward: the same values (the parameters do not change between forward and backward), through
the same ops, so the arithmetic is unchanged bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megazero.profiling.memory import record_activation


@dataclass
class _View:
    """A saved view of a gathered parameter buffer, by position."""

    shard: object  # megazero.zero.sharded._Shard
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _pack(t: torch.Tensor):
    base = t._base
    shard = getattr(base, "_megazero_shard", None) if base is not None else None
    if (shard is not None and not shard.persistent and shard.full is not None
            and t.untyped_storage().data_ptr() == shard.full.untyped_storage().data_ptr()):
        return _View(shard, t.size(), t.stride(), t.storage_offset())
    record_activation(t)  # these hooks hide the engine's ActivationMeter's own: count for it
    return t


def _unpack(packed):
    if not isinstance(packed, _View):
        return packed
    full = packed.shard.full
    if full is None:
        shapes = [tuple(shape) for shape in packed.shard.layout.shapes.values()]
        raise RuntimeError(f"ZeRO-3: backward needs a saved view of the parameters {shapes} but their unit is not "
                           f"gathered (it is fetched when the gradient of its output arrives)")
    return full.as_strided(packed.size, packed.stride, packed.offset)


def saved_parameter_views() -> torch.autograd.graph.saved_tensors_hooks:
    """The hooks, as a context manager (entered around a forward of the model)."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
