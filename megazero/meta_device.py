"""Build a module's skeleton on the meta device: shapes only, no memory, no random numbers.

Counting parameters, planning a checkpoint's layout or loading weights with `assign=True` only
needs the module's structure. Building it on the meta device allocates nothing, but its
initialisers still run: torch's meta `normal_`/`uniform_` are Python references whose first use
imports torch._dynamo and sympy (about 2 CPU-seconds per process, paid by every recipe launch).
Inside `skeleton()` in-place random fills return their tensor untouched (a meta tensor has no
values to fill) and the default generator is left where it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_RANDOM_FILLS = frozenset({"normal_", "uniform_", "trunc_normal_", "bernoulli_", "exponential_", "random_",
                           "cauchy_", "log_normal_", "geometric_"})


class _SkipRandomFills(TorchFunctionMode):
    """Returns the tensor of every in-place random fill of a meta tensor unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _RANDOM_FILLS:
            target = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by keyword
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def skeleton() -> Iterator[None]:
    """Modules built inside live on the meta device; their random initialisers draw nothing."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"), _SkipRandomFills():
        yield
