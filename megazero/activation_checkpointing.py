"""Activation checkpointing: keep a function's inputs, not its activations, and recompute its forward
during backward. Recomputation restores the RNG states of the original forward (the default
generators and the tensor-parallel tracker's), so dropout masks, and therefore gradients, are
exactly those of a run without checkpointing.

`checkpoint(function, *args)` is the call; `configure(...)` takes DeepSpeed's options (the engine
calls it with the config's `activation_checkpointing` block):

- `cpu_checkpointing`: the saved inputs live in host memory until the recompute (a copy that is a
  no-op on CPU-only runs; the code path is the same).
- `partition_activations`: each tensor-parallel rank keeps 1/TP of every saved input; backward
  all-gathers them. Only for inputs that are the same on every TP rank (a transformer layer's
  input without sequence parallelism); callers pass `partitionable=False` otherwise.
- `contiguous_memory_optimization` (with partition_activations, as in DeepSpeed): the saved pieces
  are copied into one preallocated buffer of `number_checkpoints` slots instead of separate
  allocations, so they do not fragment memory.

Without partitioning or a contiguous buffer, torch's non-reentrant checkpoint does the work; the
options that change how inputs are stored use `_StoredInputCheckpoint`, which keeps them itself.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from megazero.profiling.memory import record_activation
from megazero.tensor_parallel.random import get_rng_tracker

_DEFAULTS = {"partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
             "number_checkpoints": None, "synchronize": False, "profile": False, "tp_group": None}
_settings = dict(_DEFAULTS)


def configure(mpu=None, partition_activations: bool = False, cpu_checkpointing: bool = False,
              contiguous_memory_optimization: bool = False, number_checkpoints: int | None = None,
              synchronize_checkpoint_boundary: bool = False, profile: bool = False) -> None:
    """Set the options that later checkpoint() calls use (DeepSpeed's names); configure() resets them.

    mpu: supplies get_tensor_model_parallel_group() for partition_activations (None: one rank).
    """
    if contiguous_memory_optimization and not partition_activations:
        raise ValueError("activation_checkpointing.contiguous_memory_optimization needs partition_activations "
                         "(as in DeepSpeed)")
    if contiguous_memory_optimization and not number_checkpoints:
        raise ValueError("activation_checkpointing.contiguous_memory_optimization needs number_checkpoints (the "
                         "buffer's slots: checkpointed inputs alive at once, e.g. the number of layers)")
    tp_group = None
    if mpu is not None and hasattr(mpu, "get_tensor_model_parallel_group"):
        tp_group = mpu.get_tensor_model_parallel_group()
    _settings.update(partition_activations=partition_activations, cpu_checkpointing=cpu_checkpointing,
                     contiguous_memory_optimization=contiguous_memory_optimization,
                     number_checkpoints=number_checkpoints, synchronize=synchronize_checkpoint_boundary,
                     profile=profile, tp_group=tp_group)
    _BUFFER.reset()


def checkpoint(function, *args, partitionable: bool = True):
    """function(*args), recomputed in backward instead of storing its activations (RNG-exact).

    partitionable: the tensor arguments are identical on every tensor-parallel rank, so
    partition_activations may split them (False for per-rank tensors such as attention heads).
    """
    if _settings["synchronize"] and torch.cuda.is_available():
        torch.cuda.synchronize()
    if _settings["partition_activations"] or _settings["contiguous_memory_optimization"]:
        return _StoredInputCheckpoint.apply(function, partitionable, *args)
    for arg in args:
        if torch.is_tensor(arg):
            record_activation(arg)  # kept alive until the recompute
    offload = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) \
        if _settings["cpu_checkpointing"] else contextlib.nullcontext()
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


# ---- storing inputs ourselves: partitioned, contiguous, on the host ---------------------------
class _ContiguousBuffer:
    """number_checkpoints equal slots in one allocation; a slot is taken in forward and given back
    when its backward has run."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.storage: torch.Tensor | None = None
        self.free: list[int] = []

    def take(self, piece: torch.Tensor) -> tuple[torch.Tensor, int]:
        slots = _settings["number_checkpoints"]
        if self.storage is None:
            self.storage = torch.empty((slots, piece.numel()), dtype=piece.dtype, device=piece.device)
            self.free = list(range(slots))
        if piece.numel() != self.storage.shape[1] or piece.dtype != self.storage.dtype:
            raise RuntimeError(f"contiguous_memory_optimization: checkpointed inputs differ in size ({piece.numel()} "
                               f"{piece.dtype} vs slots of {self.storage.shape[1]} {self.storage.dtype})")
        if not self.free:
            raise RuntimeError(f"contiguous_memory_optimization: more than number_checkpoints={slots} checkpointed "
                               f"inputs are alive at once (e.g. pipeline micro-batches in flight); raise "
                               f"number_checkpoints")
        slot = self.free.pop(0)
        self.storage[slot].copy_(piece.reshape(-1))
        return self.storage[slot], slot

    def give_back(self, slot: int) -> None:
        self.free.append(slot)


_BUFFER = _ContiguousBuffer()


def _store(x: torch.Tensor, partition: bool) -> dict:
    entry = {"shape": x.shape, "device": x.device, "requires_grad": x.requires_grad, "slot": None}
    piece = x.detach().reshape(-1)
    group = _settings["tp_group"]
    world = dist.get_world_size(group) if partition and group is not None else 1
    if world > 1:
        per_rank = -(-piece.numel() // world)
        piece = torch.nn.functional.pad(piece, (0, per_rank * world - piece.numel()))
        piece = piece[dist.get_rank(group) * per_rank:(dist.get_rank(group) + 1) * per_rank].clone()
    entry["world"] = world
    if _settings["contiguous_memory_optimization"]:
        piece, entry["slot"] = _BUFFER.take(piece)
    if _settings["cpu_checkpointing"]:
        piece = piece.to("cpu")
    entry["piece"] = piece
    record_activation(piece)
    return entry


def _restore(entry: dict) -> torch.Tensor:
    piece = entry["piece"].to(entry["device"])
    if entry["world"] > 1:
        parts = [torch.empty_like(piece) for _ in range(entry["world"])]
        dist.all_gather(parts, piece.contiguous(), group=_settings["tp_group"])
        piece = torch.cat(parts)
    numel = torch.Size(entry["shape"]).numel()
    x = piece[:numel].view(entry["shape"]).clone()
    if entry["slot"] is not None:
        _BUFFER.give_back(entry["slot"])
    return x.requires_grad_(entry["requires_grad"])


def _rng_states() -> tuple:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, get_rng_tracker().get_states()


def _set_rng_states(states: tuple) -> None:
    cpu, cuda, tracker = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    get_rng_tracker().set_states(tracker)


class _StoredInputCheckpoint(torch.autograd.Function):
    """Forward without a graph, keeping the inputs as _store() says; backward restores them and the
    RNG states, recomputes with a graph and backpropagates through it."""

    @staticmethod
    def forward(ctx, function, partitionable: bool, *args):
        ctx.function = function
        ctx.rng = _rng_states()
        ctx.entries = [_store(a, partitionable) if torch.is_tensor(a) else a for a in args]
        with torch.no_grad():
            return function(*args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [_restore(e) if isinstance(e, dict) else e for e in ctx.entries]
        ctx.entries = None
        current = _rng_states()
        _set_rng_states(ctx.rng)
        try:
            with torch.enable_grad():
                outputs = ctx.function(*inputs)
        finally:
            _set_rng_states(current)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[x.grad if torch.is_tensor(x) and x.requires_grad else None for x in inputs])
