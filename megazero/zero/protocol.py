"""The one contract every data-parallel state implements (ZeRO stages 0-3, and any new one).

The engine builds one state over the optimizer's param groups (`megazero.zero.
build_data_parallel_state`), steps the optimizer over the state's fp32 masters, and asks the
state, and only through the members below, to reduce, measure, scale and write back gradients
and weights. `megazero.checkpoint` writes and reads a state through the same members, so it never
branches on the ZeRO stage nor reads a state's internals:

- Training: `optimizer_groups` and `optimizer_to_step` once; per micro-step `begin_micro_step`
  / `after_backward`; at the accumulation boundary `reduce_gradients`, (`sync_grads`),
  `grad_norm` (clip and overflow), `scale_gradients`, `attach_grads`, optimizer.step(),
  `detach_grads`, `update_model`, `start_window`.
- Wrappers (optimizer offload) wrap a `PartitionedMasters` state, whose masters are cut into
  `MasterPart`s, and use only the members those two declare.
- Checkpoint, same layout: the state's own file. `state_partitioned` says whether every data-
  parallel rank writes its own (`zero_pp_rank_{D}_mp_rank_*_optim_states.pt`) or data-parallel
  rank 0 writes one for all (`mp_rank_*_optim_states.pt`); `state_dict` is what goes in it,
  `same_layout` says whether a saved one was written by exactly this partitioning, and
  `load_state_dict` restores it (optimizer included, model updated).
- Checkpoint, any other layout (TP, PP, DP size or ZeRO stage changed): the re-cut. The files of
  every data-parallel rank of one (tensor rank, pipeline stage) are turned into whole per-parameter
  states by global name by the exporter registered for their `checkpoint_format`
  (`export_parameter_states`); those are cut to the new engine's tensor-parallel shards by
  checkpoint.universal and handed, whole per parameter, to `load_parameter_states`, which cuts its
  own partitions. `parameter_shapes` gives the shapes (a partitioned parameter is an empty tensor
  between uses), `params_partitioned` says whether the model file can hold the parameters, and
  `gathered` makes parameters whole for a moment (to write a 16-bit model file).

`stage` is metadata only: written into checkpoints and compared to decide "same layout".
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch


@dataclass
class ExportedParameterStates:
    """Whole states of one (tensor rank, pipeline stage), per parameter under its global name: what
    an exporter makes of the state files of all data-parallel ranks (padding and partitioning
    undone; tensor-parallel shards are still this tensor rank's)."""

    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # fp32 master (the weight if none)
    optimizer: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {key: whole tensor or scalar}
    group_of: dict[str, int] = field(default_factory=dict)  # name -> optimizer param group index
    param_groups: list[dict] = field(default_factory=list)  # hyperparameters of each group, no "params"


# saved: the state_dict()s of every data-parallel rank in rank order (one for a replicated state);
# module: the model file's module state (global names), for states that save no separate fp32 masters
Exporter = Callable[[list[dict], dict[str, torch.Tensor]], ExportedParameterStates]

# checkpoint formats written before a state named its format: by file kind
REPLICATED_FORMAT = "replicated"  # mp_rank_*_optim_states.pt: optimizer, param_names, master_params
FLAT_PARTITIONS_FORMAT = "flat_partitions"  # zero_pp_rank_*: master/optimizer partitions + FlatLayouts

_EXPORTERS: dict[str, Exporter] = {}


def register_checkpoint_format(name: str, exporter: Exporter) -> None:
    """Declare how state files of format `name` are turned into per-parameter states. A state whose
    files are not one of the built-in formats writes `"checkpoint_format": name` into its
    state_dict() and registers its exporter when its module is imported."""
    if name in _EXPORTERS and _EXPORTERS[name] is not exporter:
        raise ValueError(f"checkpoint format {name!r} is already registered by {_EXPORTERS[name]!r}")
    _EXPORTERS[name] = exporter


def saved_format(saved: dict, per_rank: bool) -> str:
    """The checkpoint format of a saved state file: its own "checkpoint_format" entry, else (files
    written before states named theirs) the built-in format of its kind (per_rank: a zero_pp_rank_*
    file, else an mp_rank_*_optim_states.pt file)."""
    return saved.get("checkpoint_format", FLAT_PARTITIONS_FORMAT if per_rank else REPLICATED_FORMAT)


def export_parameter_states(saved: list[dict], module: dict[str, torch.Tensor],
                            per_rank: bool) -> ExportedParameterStates:
    """Whole per-parameter states from the state files of one (tensor rank, pipeline stage), by the
    exporter of their format (see Exporter for the arguments). ValueError names an unknown format.
    The built-in states have registered theirs: importing this module imports megazero.zero first."""
    name = saved_format(saved[0], per_rank)
    if name not in _EXPORTERS:
        raise ValueError(f"state files of checkpoint format {name!r}, which no data-parallel state registered "
                       f"(known: {sorted(_EXPORTERS)})")
    return _EXPORTERS[name](saved, module)


def optimizer_state(optimizer: torch.optim.Optimizer, per_index: dict[int, dict], param_groups: list[dict]) -> dict:
    """An optimizer state dict for load_parameter_states(): `per_index` as its states (optimizer
    index -> {key: value}), `param_groups`' hyperparameters over the optimizer's own param indices."""
    current = optimizer.state_dict()
    return {"state": per_index,
            "param_groups": [{**saved, "params": now["params"]} for saved, now in
                             zip(param_groups, current["param_groups"])]}


@runtime_checkable
class DataParallelState(Protocol):
    """What the engine and the checkpoint code may ask of a data-parallel state (module docstring).

    Parameters are keyed by id(model parameter) throughout; `names` maps id(model parameter) to
    its global name (the same on every layout)."""

    stage: int  # the ZeRO stage: checkpoint metadata and "same layout" comparisons only
    checkpoint_format: ClassVar[str]  # the format of state_dict(), whose exporter is registered
    state_partitioned: bool  # True: each data-parallel rank holds (and saves) its own piece of the state
    # True: parameters are not the same whole tensors on every data-parallel rank (ZeRO-3: empty tensors
    # outside use; expert parallelism: each EP rank's own experts), so the model file holds none of them
    params_partitioned: bool
    # True: every backward reduce-scatters, each rank keeping its own partition of the reduced gradients
    # (stages 2, 3), so gradients cannot accumulate unreduced (no_sync); for a PartitionedMasters state,
    # each part's grad_partition, which a wrapper may move to swap files through grad_sink
    gradients_partitioned: bool

    # ---- training ----------------------------------------------------------------------------
    @property
    def bucket_count(self) -> int:
        """Gradient reductions per accumulation window (for reports and tests)."""

    def optimizer_groups(self, groups: list[dict]) -> list[dict]:
        """The optimizer's param groups (hyperparameters kept), over this rank's fp32 masters."""

    def optimizer_to_step(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the engine steps, given the one built over optimizer_groups(): that one
        itself, or a wrapper that steps it (optimizer offload: sub-group by sub-group)."""

    def begin_micro_step(self, boundary: bool, defer: bool = False) -> None:
        """Before a backward; `boundary`: this micro-step ends the accumulation window; `defer`: its
        gradients start no reduction and are reduced with the window's in reduce_gradients() (a
        zero-bubble pipeline schedule, whose weight gradients arrive after the backward)."""

    def after_backward(self, boundary: bool, defer: bool = False) -> None:
        """After a backward (finish what this micro-step must, e.g. free staging buffers); `defer` as
        given to begin_micro_step."""

    def reduce_gradients(self) -> None:
        """At the boundary: finish every reduction; this rank then holds its reduced gradients."""

    def grad_norm(self, counted: Callable[[torch.nn.Parameter], bool] | None = None,
                  model_parallel_group=None) -> float:
        """Global L2 norm of the (loss-scaled) reduced gradients over the data-parallel group (and
        the model-parallel group, counting parameters with counted(p) true); inf/nan on overflow."""

    def nonfinite_params(self) -> list[torch.nn.Parameter]:
        """Model parameters whose reduced gradient (this rank's piece) holds an inf or nan."""

    def sync_grads(self, params: list[torch.nn.Parameter], group) -> None:
        """Sum the reduced gradients of `params` over `group` (tied weights on other stages)."""

    def scale_gradients(self, factor: float) -> None:
        """Multiply the reduced gradients by `factor` (unscale/clip when the optimizer cannot)."""

    def attach_grads(self) -> None:
        """Point each master's .grad at its reduced fp32 gradient, for optimizer.step()."""

    def detach_grads(self) -> None:
        """Drop the masters' .grad after the step."""

    def copy_targets(self) -> dict[int, torch.Tensor]:
        """{id(master): 16-bit model tensor} an optimizer may write in its update pass ({}: none)."""

    def update_model(self, copies_written: bool = False) -> None:
        """Write the updated masters into the model (cast, all-gather as needed; the cast is skipped
        when the optimizer already wrote the copy_targets)."""

    def reset_masters(self) -> None:
        """Re-read the masters from the model (after the model's weights were loaded directly)."""

    def start_window(self) -> None:
        """Discard the gradients and start the next accumulation window."""

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds now, by kind: "parameters", "gradients", "optimizer"."""

    # ---- model shapes ------------------------------------------------------------------------
    def parameter_shapes(self) -> dict[int, torch.Size]:
        """{id(model parameter): its full (tensor-parallel-local) shape} for every parameter the
        state manages; a partitioned parameter is an empty tensor between uses, this is its shape."""

    def gathered(self, params: list[torch.nn.Parameter]) -> AbstractContextManager:
        """Context manager: `params` are whole (their .data the full tensor) inside it; a no-op for
        parameters the state does not partition."""

    # ---- checkpoint: the state's own file (same layout) --------------------------------------
    def state_dict(self, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict:
        """What this rank writes to its state file (tensors and plain values only): master weights,
        `optimizer`'s state over them and the layout they follow. A replicated state (not
        state_partitioned) is written by data-parallel rank 0 only."""

    def same_layout(self, state: dict, names: dict[int, str]) -> bool:
        """True when `state` (this rank's saved state file, from a checkpoint with the same TP, PP,
        DP size and stage) was written by exactly this partitioning, so load_state_dict() can read it."""

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        """Inverse of state_dict(): restore masters and `optimizer`, then update the model."""

    # ---- checkpoint: the re-cut to another layout --------------------------------------------
    @staticmethod
    def export_parameter_states(saved: list[dict], module: dict[str, torch.Tensor]) -> ExportedParameterStates:
        """Whole per-parameter states from the state_dict()s of every data-parallel rank (rank
        order) of one (tensor rank, pipeline stage); `module`: that stage's saved module state.
        Registered for `checkpoint_format` by register_checkpoint_format."""

    def load_parameter_states(self, optimizer: torch.optim.Optimizer, weights: dict[int, torch.Tensor],
                              states: dict[int, dict[str, Any]] | None, param_groups: list[dict]) -> None:
        """Set this rank's masters (and model) from whole fp32 weights, id(param) -> tensor shaped as
        parameter_shapes() says; with `states` (id(param) -> {key: whole tensor or scalar}; None:
        optimizer state untouched), also `optimizer`'s state, its param groups' hyperparameters
        taken from `param_groups` (one dict per optimizer param group, without "params")."""


@runtime_checkable
class MasterPart(Protocol):
    """One piece of a state that partitions its masters (stages 1-3): this rank's fp32 master
    chunks of one flat layout (megazero.zero.layout.FlatLayout), one per layout bucket, and their
    reduced gradients. Everything a wrapper (optimizer offload, gradient swap) may read or set;
    a wrapper never reaches further into a part."""

    group_index: int  # the optimizer param group of its masters
    rank: int  # this rank in the data-parallel group
    layout: Any  # the FlatLayout its masters and gradients follow
    masters: list[torch.nn.Parameter]  # this rank's fp32 chunk of each layout bucket
    grad_views: list[torch.Tensor]  # their reduced fp32 gradients
    grad_partition: torch.Tensor | None  # the storage of grad_views (None: they view a full buffer)
    grad_sink: Any  # when set, reduced chunks are handed to it (megazero.zero.grad_swap), not added here
    aliased: bool  # the masters are the fp32 model's own storage (nothing to cast back)
    # the flat fp32 storage the masters view (None when aliased); a wrapper that moves the masters
    # (to host memory, out to a swap file) sets it with them
    master_flat: torch.Tensor | None
    # the masters are not made yet: their values are the parameter partition's (master_values), in a
    # swap file (stage 3 parameter offload); a wrapper clears it once it has written them elsewhere
    master_deferred: bool

    def master_values(self, index: int) -> torch.Tensor:
        """The values of master `index`: itself, or when deferred the parameter chunk holding them
        (inside partition_loaded())."""

    def partition_loaded(self) -> AbstractContextManager:
        """Context manager: the 16-bit parameter partition is in memory inside (parameter offload
        reads it from its swap file; a no-op where it never leaves memory)."""

    def write_master(self, index: int, first: bool, last: bool) -> None:
        """Cast master `index` into this rank's chunk of the 16-bit parameters, as update_model would
        (`first`/`last`: the first/last of this part's masters written in this pass: a swapped
        partition is held from the first and written back after the last)."""


@runtime_checkable
class PartitionedMasters(DataParallelState, Protocol):
    """A DataParallelState whose masters and reduced gradients are cut into MasterParts (ZeRO stages
    1-3): what optimizer offload (megazero.zero.offload) wraps, asking only these members."""

    parts: list[MasterPart]  # in optimizer order: the masters of all parts follow one another
    group: Any  # the data-parallel process group
    # True: parameter partitions live in swap files (stage 3 parameter offload): masters are cast
    # into them part by part (write_master), never all resident at once
    params_in_swap: bool


__all__ = ["DataParallelState", "MasterPart", "PartitionedMasters", "ExportedParameterStates", "Exporter",
           "FLAT_PARTITIONS_FORMAT", "REPLICATED_FORMAT", "export_parameter_states", "optimizer_state",
           "register_checkpoint_format", "saved_format"]
