"""Activation checkpointing: keep a function's inputs, not its activations, and recompute its forward
during backward. Recomputation restores the RNG states of the original forward, so dropout masks
(and therefore gradients) are exactly those of a run without checkpointing.

`checkpoint(function, *args)` is the call; `configure(...)` takes DeepSpeed's options. Implemented:
`cpu_checkpointing` (saved inputs are kept in host memory and moved back for the recompute).
`partition_activations` and `contiguous_memory_optimization` need tensor parallelism and are
refused with an error until it exists, rather than silently ignored.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint

from megazero.tensor_parallel.random import get_rng_tracker

_settings = {"cpu_checkpointing": False}


def configure(mpu=None, partition_activations: bool = False, cpu_checkpointing: bool = False,
              contiguous_memory_optimization: bool = False, number_checkpoints: int | None = None,
              synchronize_checkpoint_boundary: bool = False, profile: bool = False) -> None:
    """Set the options that later checkpoint() calls use (DeepSpeed's names)."""
    if partition_activations or contiguous_memory_optimization:
        raise NotImplementedError("activation_checkpointing: partition_activations and "
                                  "contiguous_memory_optimization need tensor parallelism, which megazero "
                                  "does not have yet")
    _settings["cpu_checkpointing"] = cpu_checkpointing
    _settings["synchronize"] = synchronize_checkpoint_boundary


def checkpoint(function, *args):
    """function(*args), recomputed in backward instead of storing its activations (RNG-exact)."""
    offload = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) \
        if _settings["cpu_checkpointing"] else contextlib.nullcontext()
    if _settings.get("synchronize") and torch.cuda.is_available():
        torch.cuda.synchronize()
    with offload:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                                                 context_fn=_tracker_contexts)


def _tracker_contexts():
    """Forward: nothing. Recompute: the tensor-parallel RNG tracker's states as they were in the
    forward (torch restores the default generators; the tracker's own states are ours to restore)."""
    tracker = get_rng_tracker()
    saved = tracker.get_states()

    @contextlib.contextmanager
    def recompute():
        current = tracker.get_states()
        tracker.set_states(saved)
        try:
            yield
        finally:
            tracker.set_states(current)

    return contextlib.nullcontext(), recompute()
