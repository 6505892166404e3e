"""A checkpoint seen independently of the layout that wrote it, and applied to any other layout.

`read_parameter_states(path)` reads every file of a checkpoint (any tensor/pipeline/data-parallel
size, any ZeRO stage) and reassembles, per parameter under its global name: the whole fp32
weight (the master; the module's weight where there is none), each whole optimizer state tensor
(Adam's moments, step, ...), its optimizer param group, and the module's other state.
`apply_parameter_states(engine, states)` cuts those for the engine's own layout: its tensor-
parallel shard (along each parameter's partition dimension), its pipeline stage (by name), and
its ZeRO partition. Loading at the same layout does not come here: each rank reads its own files.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import torch

from megazero.checkpoint.files import MODEL_FILES, model_file, model_files_in, optim_file, zero_files_of
from megazero.checkpoint.io import CheckpointError, check_format_version, load_file
from megazero.checkpoint.zero_state import cut_partition, per_parameter_states, read_zero_states
from megazero.tensor_parallel.utils import is_tensor_parallel, merge_shards, shard_of


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


def _stage_states(path: str, state: dict, tp_rank: int, pp_rank: int) -> tuple[dict, dict, dict]:
    """(weights, optimizer states, group index) by name for one (tensor rank, pipeline stage)."""
    layout = saved_layout(state)
    weights, optimizer, group_of = {}, {}, {}
    if layout["zero_stage"] == 0:
        optim = load_file(os.path.join(path, optim_file(tp_rank, pp_rank, layout["pp"])))
        names = optim["param_names"]
        masters = optim["master_params"] or [state["module"][n] for n in names]
        weights = {n: t.float() for n, t in zip(names, masters)}
        saved = optim["optimizer"]
        for gi, group in enumerate(saved["param_groups"]):
            for index in group["params"]:
                group_of[names[index]] = gi
                optimizer[names[index]] = dict(saved["state"].get(index, {}))
        return weights, optimizer, group_of
    files = zero_files_of(path, tp_rank, pp_rank, layout["pp"])
    states = read_zero_states(path, files)
    for part, saved in zip(states[0]["groups"], per_parameter_states(states)):
        for name, tensor in saved["master"].items():
            weights[name] = tensor.float()
            group_of[name] = part["group_index"]
            optimizer[name] = {**{k: v.clone() if torch.is_tensor(v) else v for k, v in saved["_scalars"].items()},
                               **{k: t[name] for k, t in saved.items() if k not in ("master", "_scalars")}}
    return weights, optimizer, group_of


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
            weights, optimizer, group_of = _stage_states(path, state, tp_rank, pp_rank)
            out.meta.update(state.get("param_meta", {}))
            out.group_of.update(group_of)
            by_rank.setdefault(pp_rank, []).append((weights, optimizer, state["module"]))
    out.param_groups = _param_groups(path, layout)
    for stage in by_rank.values():
        _merge_tensor_parallel(out, stage)
    return out


def _param_groups(path: str, layout: dict) -> list[dict]:
    if layout["zero_stage"] == 0:
        saved = load_file(os.path.join(path, optim_file(0, 0, layout["pp"])))["optimizer"]
    else:
        saved = read_zero_states(path, zero_files_of(path, 0, 0, layout["pp"]))[0]["optimizer"]
    return [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]


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
    """Set the engine's weights (and optimizer states) from whole per-parameter states."""
    shapes = _local_shapes(engine)
    vocab_size = saved_vocab_size(states)
    locals_by_key: dict[str, dict[int, torch.Tensor]] = {"weight": {}}
    scalars: dict[int, dict] = {}
    for p in engine.module.parameters():
        if id(p) not in global_names:
            continue
        name = global_names[id(p)]
        if name not in states.weights:
            raise CheckpointError(f"parameter {name} is not in the checkpoint")
        locals_by_key["weight"][id(p)] = local_shard(states.weights[name], p, shapes[id(p)], engine.grid, name,
                                                     vocab_size)
        if load_optimizer_states:
            scalars[id(p)] = {}
            for key, value in states.optimizer[name].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    locals_by_key.setdefault(key, {})[id(p)] = local_shard(value, p, shapes[id(p)], engine.grid,
                                                                           name, vocab_size)
                else:
                    scalars[id(p)][key] = value
    if load_optimizer_states and len(states.param_groups) != len(engine.optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(states.param_groups)} param groups, the "
                              f"engine's {len(engine.optimizer.param_groups)}")
    if engine.dp.stage == 0:
        _apply_replicated(engine, locals_by_key, scalars, states, load_optimizer_states)
    else:
        _apply_partitioned(engine, locals_by_key, scalars, states, load_optimizer_states)


def _local_shapes(engine) -> dict[int, torch.Size]:
    if engine.dp.stage == 3:  # partitioned parameters are empty tensors: their layouts know the shapes
        return {id(p): part.layout.shapes[p] for part in engine.dp.parts for p in part.layout.params}
    return {id(p): p.shape for p in engine.module.parameters()}


def _optimizer_state(engine, states: ParameterStates, per_index: dict[int, dict]) -> dict:
    current = engine.optimizer.state_dict()
    return {"state": per_index,
            "param_groups": [{**saved, "params": now["params"]} for saved, now in
                             zip(states.param_groups, current["param_groups"])]}


def _apply_replicated(engine, tensors: dict, scalars: dict, states: ParameterStates, with_optimizer: bool) -> None:
    master = engine.dp.master
    with torch.no_grad():
        for model_param, master_param in zip(master.model_params, master.params):
            master_param.copy_(tensors["weight"][id(model_param)].view_as(master_param))
    master.copy_to_model()
    if not with_optimizer:
        return
    per_index = {}
    for i, p in enumerate(master.model_params):
        entry = {**{k: v.clone() if torch.is_tensor(v) else v for k, v in scalars[id(p)].items()},
                 **{k: t[id(p)].reshape(p.shape).clone() for k, t in tensors.items() if k != "weight"}}
        if entry:
            per_index[i] = entry
    engine.optimizer.load_state_dict(_optimizer_state(engine, states, per_index))


def _apply_partitioned(engine, tensors: dict, scalars: dict, states: ParameterStates, with_optimizer: bool) -> None:
    from megazero.zero.master_partitions import load_master_partition

    per_index, index = {}, 0
    for part in engine.dp.parts:
        rank = engine.dp_rank
        load_master_partition(part, cut_partition(part.layout, rank, tensors["weight"]))
        cut = {key: part.layout.split_partition(cut_partition(part.layout, rank, by_param))
               for key, by_param in tensors.items() if key != "weight"}
        first_scalars = scalars.get(id(part.layout.params[0]), {}) if with_optimizer else {}
        for b in range(len(part.masters)):
            if with_optimizer and (cut or first_scalars):
                entry = {k: v.clone() if torch.is_tensor(v) else v for k, v in first_scalars.items()}
                per_index[index] = {**entry, **{k: v[b].clone() for k, v in cut.items()}}
            index += 1
    if with_optimizer:
        engine.optimizer.load_state_dict(_optimizer_state(engine, states, per_index))
    engine.dp.update_model()
