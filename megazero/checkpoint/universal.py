"""A checkpoint seen independently of the layout that wrote it, and applied to any other layout.

`read_parameter_states(path)` reads every file of a checkpoint (any tensor/pipeline/data-parallel
size, any ZeRO stage) and reassembles, per parameter under its global name: the whole fp32
weight (the master; the module's weight where there is none), each whole optimizer state tensor
(Adam's moments, step, ...), its optimizer param group, and the module's other state.
`apply_parameter_states(engine, states)` cuts those for the engine's own layout: its tensor-
parallel shard (along each parameter's partition dimension), its pipeline stage (by name), and
its data-parallel partition. Neither side knows the ZeRO stage: the files are decoded by the exporter
of the format the writing state registered, and the engine's data-parallel state cuts its own
partitions (megazero.zero.protocol). Loading at the same layout does not come here: each rank
reads its own files.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import torch

from megazero.checkpoint.files import MODEL_FILES, ZERO_FILES, model_file, model_files_in, optim_file, zero_files_of
from megazero.checkpoint.io import CheckpointError, check_format_version, load_file
from megazero.tensor_parallel.utils import is_tensor_parallel, merge_shards, shard_of
from megazero.zero.protocol import ExportedParameterStates, export_parameter_states


@dataclass
class ParameterStates:
    """Whole per-parameter states of a checkpoint, keyed by global parameter name."""

    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # fp32
    optimizer: dict[str, dict] = field(default_factory=dict)  # name -> {state key: tensor}
    group_of: dict[str, int] = field(default_factory=dict)
    param_groups: list[dict] = field(default_factory=list)  # hyperparameters, without "params"
    module: dict[str, torch.Tensor] = field(default_factory=dict)  # module state as saved (no ZeRO-3 params)
    meta: dict[str, list] = field(default_factory=dict)  # name -> [partition_dim or None, stride]
    engine: dict = field(default_factory=dict)  # the first model file: counters, schedule, layout, ...


def saved_layout(state: dict) -> dict:
    """The layout a model file was written with (checkpoints from before model parallelism: 1 x 1)."""
    return state.get("layout") or {"tp": 1, "pp": 1, "dp": state["dp_world_size"], "zero_stage": state["zero_stage"]}


def read_state_files(path: str, tp_rank: int, pp_rank: int, pp: int) -> tuple[list[dict], bool]:
    """The data-parallel state files of one (tensor rank, pipeline stage) and whether they are per
    data-parallel rank: every rank's ZeRO file, loaded in rank order, or the one optimizer file a
    replicated state writes."""
    files = zero_files_of(path, tp_rank, pp_rank, pp)
    if not files:
        name = optim_file(tp_rank, pp_rank, pp)
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"{path}: neither {name} nor {ZERO_FILES} files of tensor rank {tp_rank}, "
                                  f"pipeline stage {pp_rank}")
        return [load_file(os.path.join(path, name))], False
    if sorted(files) != list(range(len(files))):
        raise CheckpointError(f"{path}: ZeRO files for data-parallel ranks {sorted(files)}; some are missing")
    return [load_file(files[r]) for r in range(len(files))], True


def _stage_states(path: str, state: dict, tp_rank: int, pp_rank: int) -> ExportedParameterStates:
    """Whole per-parameter states of one (tensor rank, pipeline stage), by the exporter of the
    format its data-parallel state wrote (megazero.zero.protocol)."""
    saved, per_rank = read_state_files(path, tp_rank, pp_rank, saved_layout(state)["pp"])
    try:
        return export_parameter_states(saved, state["module"], per_rank)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e


def read_parameter_states(path: str) -> ParameterStates:
    """Every file of the checkpoint at `path`, reassembled per parameter (see the module docstring)."""
    files = model_files_in(path)
    if not files:
        raise CheckpointError(f"{path}: no {MODEL_FILES} files")
    first = load_file(files[0])
    check_format_version(first, files[0])
    layout = saved_layout(first)  # every model file records the same layout
    out = ParameterStates()
    by_rank: dict[int, list] = {}  # pipeline stage -> per tensor rank (weights, optimizer, module)
    for pp_rank in range(layout["pp"]):
        for tp_rank in range(layout["tp"]):
            name = os.path.join(path, model_file(tp_rank, pp_rank, layout["pp"]))
            if not os.path.isfile(name):
                raise CheckpointError(f"{path}: {os.path.basename(name)} is missing (saved with tensor parallel "
                                      f"size {layout['tp']} and pipeline parallel size {layout['pp']})")
            state = load_file(name)
            if not out.engine:
                out.engine = state
            exported = _stage_states(path, state, tp_rank, pp_rank)
            if not out.param_groups:  # every stage's optimizer has the same groups: the first file's
                out.param_groups = exported.param_groups
            out.meta.update(state.get("param_meta", {}))
            out.group_of.update(exported.group_of)
            by_rank.setdefault(pp_rank, []).append((exported.weights, exported.optimizer, state["module"]))
    for stage in by_rank.values():
        _merge_tensor_parallel(out, stage)
    return out


def _merge(name: str, shards: list[torch.Tensor], meta: dict) -> torch.Tensor:
    dim, stride = meta.get(name, [None, 1])
    if dim is None or len(shards) == 1 or shards[0].dim() == 0:
        return shards[0]
    return merge_shards(shards, dim, stride)


def _merge_tensor_parallel(out: ParameterStates, ranks: list[tuple[dict, dict, dict]]) -> None:
    """Join one pipeline stage's tensor-parallel shards; names already seen (the tied embedding's
    copy on the last stage) keep the first stage's values."""
    weights, optimizer, module = ranks[0]
    for name in weights:
        if name in out.weights:
            continue
        out.weights[name] = _merge(name, [r[0][name] for r in ranks], out.meta)
        out.optimizer[name] = {key: _merge(name, [r[1][name][key] for r in ranks], out.meta)
                               if torch.is_tensor(value) else value for key, value in optimizer[name].items()}
    for name in module:
        if name not in out.module:
            out.module[name] = _merge(name, [r[2][name] for r in ranks], out.meta)


# ---- applying to an engine ---------------------------------------------------------------
def saved_vocab_size(states: ParameterStates) -> int | None:
    """The true vocabulary of the model a checkpoint holds (its model_config's vocab_size; None
    for a model saved without one): rows from there on are padding."""
    return (states.engine.get("model_config") or {}).get("vocab_size")


def fit_vocabulary_rows(full: torch.Tensor, rows: int, name: str, vocab_size: int | None) -> torch.Tensor:
    """Pad (zeros) or trim dimension 0 to `rows`: the vocabulary padding depends on the tensor-
    parallel size. Models leave the padding rows out of their function (models/common.py), so
    adding or dropping them changes nothing, and happens silently. Anything else is an error: a
    dropped row that is a token, or (vocab_size given) a saved or expected row count below it.
    vocab_size None (a model saved without a model_config): the rows cannot be told apart, so
    they are fitted with a warning."""
    if full.shape[0] == rows:
        return full
    if vocab_size is None:
        warnings.warn(f"{name}: {full.shape[0]} rows saved, {rows} expected, and the checkpoint has no "
                      f"model_config.vocab_size to tell padding rows from tokens; rows are "
                      f"{'added as zeros' if rows > full.shape[0] else 'dropped'}", stacklevel=4)
    elif max(rows, full.shape[0]) < vocab_size:  # not a vocabulary tensor: another model shape
        raise CheckpointError(f"{name}: shape {tuple(full.shape)} saved, this model's has {rows} rows: the model "
                              f"configs differ (a size such as --hidden-size, --ffn-hidden-size, "
                              f"--num-attention-heads or --num-query-groups changed); load it with the saved "
                              f"model config, or save the new model to another directory")
    elif min(rows, full.shape[0]) < vocab_size:
        raise CheckpointError(f"{name}: {full.shape[0]} rows saved, {rows} expected, but the vocabulary has "
                              f"{vocab_size} tokens: only padding rows (from {vocab_size} on) can be added or "
                              f"dropped; the model configs differ")
    if rows < full.shape[0]:
        return full[:rows].clone()
    return torch.cat([full, full.new_zeros((rows - full.shape[0], *full.shape[1:]))])


def local_shard(full: torch.Tensor, param: torch.nn.Parameter, shape: torch.Size, grid, name: str,
                vocab_size: int | None = None) -> torch.Tensor:
    """This rank's piece of a whole tensor saved for `param` (whose local shape is `shape`);
    vocab_size: the saved model's vocabulary (see fit_vocabulary_rows)."""
    if full.dim() == 0 or not is_tensor_parallel(param):
        return full
    tp = grid.tensor_model_parallel_size if grid is not None else 1
    dim, stride = param.partition_dim, param.partition_stride
    if dim == 0:
        full = fit_vocabulary_rows(full, shape[0] * tp, name, vocab_size)
    return shard_of(full, dim, tp, grid.tp_rank if grid is not None else 0, stride) if tp > 1 else full


def apply_parameter_states(engine, states: ParameterStates, load_optimizer_states: bool,
                           global_names: dict[int, str]) -> None:
    """Set the engine's weights (and optimizer states) from whole per-parameter states: cut to its
    tensor-parallel shards here, to its data-parallel partitions by its state (load_parameter_states)."""
    shapes = engine.dp.parameter_shapes()  # a partitioned parameter is an empty tensor: its state knows the shape
    vocab_size = saved_vocab_size(states)
    weights: dict[int, torch.Tensor] = {}
    per_param: dict[int, dict] | None = {} if load_optimizer_states else None
    for p in engine.module.parameters():
        if id(p) not in global_names:
            continue
        name = global_names[id(p)]
        if name not in states.weights:
            raise CheckpointError(f"parameter {name} is not in the checkpoint")
        shape = shapes.get(id(p), p.shape)
        weights[id(p)] = local_shard(states.weights[name], p, shape, engine.grid, name, vocab_size)
        if per_param is not None:
            per_param[id(p)] = {key: local_shard(value, p, shape, engine.grid, name, vocab_size)
                                if torch.is_tensor(value) and value.dim() > 0 else value
                                for key, value in states.optimizer[name].items()}
    if load_optimizer_states and len(states.param_groups) != len(engine.optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(states.param_groups)} param groups, the "
                              f"engine's {len(engine.optimizer.param_groups)}")
    engine.dp.load_parameter_states(engine.optimizer, weights, per_param, states.param_groups)
