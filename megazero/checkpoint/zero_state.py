"""Optimizer-state files of partitioned (ZeRO 1/2) engines, re-cut on load for any data-parallel size.

Each data-parallel rank writes `zero_pp_rank_{dp}_mp_rank_00_optim_states.pt` holding its fp32
master partitions, its optimizer state dict (over those partitions) and the layout they follow
(parameter names and flat offsets, buckets with their partition offsets, world size). Loading at
the same size reads the rank's own file; at another size every file is read, each state tensor
(master weights, Adam moments, ...) is reassembled per parameter, and cut again for the new layout.
The per-parameter view is also what zero_to_fp32 writes.
"""

from __future__ import annotations

import glob
import os
import re

import torch

from megazero.checkpoint.io import CheckpointError, load_file
from megazero.zero.layout import FlatLayout
from megazero.zero.master_partitions import load_master_partition, master_partition

ZERO_FILE = "zero_pp_rank_{dp}_mp_rank_00_optim_states.pt"
_ZERO_FILE_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


def layout_meta(layout: FlatLayout, names: dict[int, str]) -> dict:
    """Plain description of a FlatLayout: enough to reassemble any partition of it."""
    return {
        "world_size": layout.world_size,
        "numel": layout.numel,
        "names": [names[id(p)] for p in layout.params],
        "shapes": [list(layout.shapes[p]) for p in layout.params],
        "offsets": [layout.offsets[p] for p in layout.params],
        "buckets": [[b.start, b.numel, b.partition_offset] for b in layout.buckets],
    }


def zero_state(engine, names: dict[int, str]) -> dict:
    """What one rank of a partitioned engine writes."""
    return {
        "zero_stage": engine.dp.stage,
        "dp_world_size": engine.dp_world_size,
        "dp_rank": engine.dp_rank,
        "optimizer": engine.optimizer.state_dict(),
        "groups": [{"master": master_partition(part), "num_masters": len(part.masters),
                    "layout": layout_meta(part.layout, names)} for part in engine.dp.parts],
    }


def gather_partitions(meta: dict, partitions: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-parameter full tensors (shaped like the parameter) from every rank's partition of one group."""
    world = meta["world_size"]
    if len(partitions) != world:
        raise CheckpointError(f"expected {world} partitions, found {len(partitions)}")
    full = torch.zeros(meta["numel"], dtype=partitions[0].dtype)
    for rank, part in enumerate(partitions):
        for start, numel, partition_offset in meta["buckets"]:
            chunk = numel // world
            full[start + rank * chunk:start + (rank + 1) * chunk] = part[partition_offset:partition_offset + chunk]
    out = {}
    for name, shape, offset in zip(meta["names"], meta["shapes"], meta["offsets"]):
        numel = int(torch.Size(shape).numel())
        out[name] = full[offset:offset + numel].view(shape).clone()
    return out


def cut_partition(layout: FlatLayout, rank: int, tensors: dict[str, torch.Tensor], names: dict[int, str],
                  dtype=torch.float32) -> torch.Tensor:
    """`rank`'s partition of `layout`, filled from per-parameter tensors (padding stays zero)."""
    out = torch.zeros(layout.partition_numel, dtype=dtype)
    for frag in layout.fragments(rank):
        source = tensors[names[id(frag.param)]].reshape(-1)
        out[frag.partition_start:frag.partition_start + frag.numel] = source[frag.param_start:
                                                                            frag.param_start + frag.numel]
    return out


def read_zero_files(path: str) -> list[dict]:
    """Every rank's ZeRO file in a checkpoint directory, in rank order."""
    files = {}
    for f in glob.glob(os.path.join(path, "zero_pp_rank_*_optim_states.pt")):
        match = _ZERO_FILE_RE.search(f)
        if match:
            files[int(match.group(1))] = f
    if not files:
        raise CheckpointError(f"{path}: no zero_pp_rank_*_optim_states.pt files")
    if sorted(files) != list(range(len(files))):
        raise CheckpointError(f"{path}: ZeRO files for ranks {sorted(files)}; some are missing")
    states = [load_file(files[r]) for r in range(len(files))]
    world = states[0]["dp_world_size"]
    if len(states) != world:
        raise CheckpointError(f"{path}: {len(states)} ZeRO files, but they were written by {world} ranks")
    return states


def _optimizer_indices(groups: list[dict]) -> list[list[int]]:
    """Optimizer state indices of each part's masters (they follow one another in part order)."""
    out, start = [], 0
    for group in groups:
        out.append(list(range(start, start + group["num_masters"])))
        start += group["num_masters"]
    return out


def per_parameter_states(states: list[dict]) -> list[dict[str, dict[str, torch.Tensor]]]:
    """For each part: {'master': {name: tensor}, '<optimizer key>': {name: tensor}, ...}, plus the
    non-tensor-per-element entries (e.g. Adam's step) under '_scalars'."""
    out = []
    indices = _optimizer_indices(states[0]["groups"])
    for g, group in enumerate(states[0]["groups"]):
        meta = group["layout"]
        result = {"master": gather_partitions(meta, [s["groups"][g]["master"] for s in states])}
        first = states[0]["optimizer"]["state"].get(indices[g][0], {})
        result["_scalars"] = {k: v for k, v in first.items() if not (torch.is_tensor(v) and v.dim() == 1)}
        for key in [k for k, v in first.items() if torch.is_tensor(v) and v.dim() == 1]:
            partitions = [torch.cat([s["optimizer"]["state"][i][key].reshape(-1) for i in indices[g]]) for s in states]
            result[key] = gather_partitions(meta, partitions)
        out.append(result)
    return out


def load_zero_state(engine, path: str, names: dict[int, str]) -> None:
    """Restore master partitions and optimizer state, re-cutting them when the DP size changed."""
    own = os.path.join(path, ZERO_FILE.format(dp=engine.dp_rank))
    if os.path.isfile(own):
        state = load_file(own)
        if state["dp_world_size"] == engine.dp_world_size and _same_layouts(engine, state, names):
            _apply(engine, state["optimizer"], [g["master"] for g in state["groups"]])
            return
    states = read_zero_files(path)
    groups = per_parameter_states(states)
    if len(groups) != len(engine.dp.parts):
        raise CheckpointError(f"{path}: {len(groups)} parameter partitions saved, the engine has "
                              f"{len(engine.dp.parts)}")
    current = engine.optimizer.state_dict()
    optimizer = {"state": {}, "param_groups": [{**saved, "params": now["params"]} for saved, now in
                                               zip(states[0]["optimizer"]["param_groups"], current["param_groups"])]}
    masters, index = [], 0
    for part, saved in zip(engine.dp.parts, groups):
        masters.append(cut_partition(part.layout, engine.dp_rank, saved["master"], names))
        cut = {key: part.layout.split_partition(cut_partition(part.layout, engine.dp_rank, tensors, names))
               for key, tensors in saved.items() if key not in ("master", "_scalars")}
        for b in range(len(part.masters)):
            if cut or saved["_scalars"]:
                # every master gets its own copy: optimizers update e.g. Adam's step tensor in place
                scalars = {k: v.clone() if torch.is_tensor(v) else v for k, v in saved["_scalars"].items()}
                optimizer["state"][index] = {**scalars, **{k: v[b].clone() for k, v in cut.items()}}
            index += 1
    _apply(engine, optimizer, masters)


def _same_layouts(engine, state: dict, names: dict[int, str]) -> bool:
    saved = [g["layout"] for g in state["groups"]]
    return saved == [layout_meta(part.layout, names) for part in engine.dp.parts]


def _apply(engine, optimizer_state: dict, masters: list[torch.Tensor]) -> None:
    engine.optimizer.load_state_dict(optimizer_state)
    for part, master in zip(engine.dp.parts, masters):
        if master.numel() != part.layout.partition_numel:
            raise CheckpointError(f"master partition of {master.numel()} elements, expected "
                                  f"{part.layout.partition_numel}")
        load_master_partition(part, master)
    engine.dp.update_model()
