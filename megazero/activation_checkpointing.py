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
- `synchronize_checkpoint_boundary`: synchronize the device at the start and end of every
  checkpointed forward and of every recompute-and-backward (CUDA: `torch.cuda.synchronize`; on CPU
  there is nothing to wait for). Each boundary is a `torch.profiler` range named
  `megazero.checkpoint_boundary_synchronize`, so traces show them.
- `profile`: time every checkpointed forward and every recompute-and-backward (device-synchronized)
  and print each on rank 0, as DeepSpeed does; `checkpoint_stats()` holds the totals.

`checkpoint_stats()` also counts checkpointed forwards and recomputes since the last configure().
Without partitioning, a contiguous buffer, synchronization or profiling, torch's non-reentrant
checkpoint does the work; the other options use `_StoredInputCheckpoint`, which keeps the inputs
itself and has a backward of its own to delimit.

Three names, two meanings: this module is activation checkpointing (recomputation);
`megazero.checkpointing` is only DeepSpeed's name for it (`deepspeed.checkpointing`), an alias with
these same objects; `megazero.checkpoint` (the package) is training-state checkpoints (save/load).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from megazero.profiling.memory import record_activation
from megazero.tensor_parallel.random import get_rng_tracker, layout_invariant_keys, sample_keys_restored

__all__ = ["SYNCHRONIZE_RANGE", "checkpoint", "checkpoint_stats", "configure", "settings"]
_DEFAULTS = {"partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
             "number_checkpoints": None, "synchronize": False, "profile": False, "tp_group": None}
_settings = dict(_DEFAULTS)
_STAT_KEYS = ("forwards", "recomputes", "synchronized_boundaries", "forward_ms", "backward_ms")
_stats: dict[str, float] = dict.fromkeys(_STAT_KEYS, 0)
SYNCHRONIZE_RANGE = "megazero.checkpoint_boundary_synchronize"


def configure(mpu=None, partition_activations: bool = False, cpu_checkpointing: bool = False,
              contiguous_memory_optimization: bool = False, number_checkpoints: int | None = None,
              synchronize_checkpoint_boundary: bool = False, profile: bool = False) -> None:
    """Set the options that later checkpoint() calls use (DeepSpeed's names); configure() resets them
    (and checkpoint_stats()).

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
    _stats.update(dict.fromkeys(_STAT_KEYS, 0))
    _BUFFER.reset()


def settings() -> dict:
    """The options in effect (DeepSpeed's names; `synchronize` is synchronize_checkpoint_boundary)."""
    return {k: v for k, v in _settings.items() if k != "tp_group"}


def checkpoint_stats() -> dict[str, float]:
    """Since the last configure(): checkpointed forwards, recomputes in backward, device
    synchronizations at checkpoint boundaries, and (with profile) the milliseconds spent in
    checkpointed forwards and in recompute-and-backward."""
    return dict(_stats)


def _boundary() -> None:
    """synchronize_checkpoint_boundary: wait for the device's queued work at a checkpoint boundary."""
    if not _settings["synchronize"]:
        return
    with torch.profiler.record_function(SYNCHRONIZE_RANGE):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    _stats["synchronized_boundaries"] += 1


class _Phase:
    """One checkpoint phase ('forward' or 'backward'): synchronized at both ends, timed and printed
    on rank 0 with profile (the end is synchronized before the clock stops, as DeepSpeed's timers)."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        _boundary()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        _boundary()
        if not _settings["profile"]:
            return
        if not _settings["synchronize"] and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        ms = 1000 * (time.perf_counter() - self.start)
        _stats[f"{self.name}_ms"] += ms
        if not dist.is_initialized() or dist.get_rank() == 0:
            label = "forward" if self.name == "forward" else "recompute and backward"
            print(f"[megazero] activation checkpoint {label}: {ms:.2f} ms", flush=True)


def checkpoint(function, *args, partitionable: bool = True):
    """function(*args), recomputed in backward instead of storing its activations (RNG-exact).

    partitionable: the tensor arguments are identical on every tensor-parallel rank, so
    partition_activations may split them (False for per-rank tensors such as attention heads).
    """
    _stats["forwards"] += 1
    if any(_settings[k] for k in ("partition_activations", "contiguous_memory_optimization", "synchronize",
                                  "profile")):
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
    forward (torch restores the default generators; the tracker's own states are ours to restore),
    and the forward's layout-invariant dropout keys (the recompute runs outside its micro-batch)."""
    tracker = get_rng_tracker()
    saved, keys = tracker.get_states(), layout_invariant_keys()

    @contextlib.contextmanager
    def recompute():
        _stats["recomputes"] += 1
        current = tracker.get_states()
        tracker.set_states(saved)
        try:
            with sample_keys_restored(keys):
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
    # the stride order too: a kernel on the restored input (a transposed view of heads, say) may
    # round differently from one on a contiguous copy, and the recompute must repeat the forward
    order = torch.empty_like(x, device="meta").stride()
    entry = {"shape": x.shape, "stride": order, "device": x.device, "requires_grad": x.requires_grad, "slot": None}
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
    x = torch.empty_strided(entry["shape"], entry["stride"], dtype=piece.dtype, device=piece.device)
    x.copy_(piece[:numel].view(entry["shape"]))
    if entry["slot"] is not None:
        _BUFFER.give_back(entry["slot"])
    return x.requires_grad_(entry["requires_grad"])


def _rng_states() -> tuple:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, get_rng_tracker().get_states(), layout_invariant_keys()


def _set_rng_states(states: tuple) -> None:
    cpu, cuda, tracker, _ = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    get_rng_tracker().set_states(tracker)


class _StoredInputCheckpoint(torch.autograd.Function):
    """Forward without a graph, keeping the inputs as _store() says; backward restores them and the
    RNG states, recomputes with a graph and backpropagates through it."""

    @staticmethod
    def forward(ctx, function, partitionable: bool, *args):
        with _Phase("forward"):
            ctx.function = function
            ctx.rng = _rng_states()
            split = partitionable and _settings["partition_activations"]
            ctx.entries = [_store(a, split) if torch.is_tensor(a) else a for a in args]
            with torch.no_grad():
                return function(*args)

    @staticmethod
    def backward(ctx, *grads):
        with _Phase("backward"):
            inputs = [_restore(e) if isinstance(e, dict) else e for e in ctx.entries]
            ctx.entries = None
            current = _rng_states()
            _set_rng_states(ctx.rng)
            _stats["recomputes"] += 1
            try:
                with torch.enable_grad(), sample_keys_restored(ctx.rng[3]):
                    outputs = ctx.function(*inputs)
            finally:
                _set_rng_states(current)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            return (None, None, *[x.grad if torch.is_tensor(x) and x.requires_grad else None for x in inputs])
