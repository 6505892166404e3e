"""Optimizer-state files of partitioned (ZeRO 1-3) engines.

Each data-parallel rank writes `zero_pp_rank_{dp}_mp_rank_{tp}[_{pp}]_optim_states.pt` holding its
fp32 master partitions, its optimizer state dict (over those partitions) and the layout they
follow (global parameter names and flat offsets, buckets with their partition offsets, world
size). Loading at the same layout reads the rank's own file; otherwise every file is read and
each state tensor (master weights, Adam moments, ...) is reassembled per parameter
(per_parameter_states) and cut again for the new layout (checkpoint.universal).
"""

from __future__ import annotations

import torch

from megazero.checkpoint.files import ZERO_FILES
from megazero.checkpoint.io import CheckpointError, load_file
from megazero.zero.layout import FlatLayout
from megazero.zero.master_partitions import load_master_partition, master_partition


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
                    "group_index": part.group_index, "layout": layout_meta(part.layout, names)}
                   for part in engine.dp.parts],
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


def cut_partition(layout: FlatLayout, rank: int, tensors: dict[int, torch.Tensor], dtype=torch.float32) -> torch.Tensor:
    """`rank`'s partition of `layout`, filled from whole tensors keyed by id(param) (padding stays zero)."""
    out = torch.zeros(layout.partition_numel, dtype=dtype)
    for frag in layout.fragments(rank):
        source = tensors[id(frag.param)].reshape(-1)
        out[frag.partition_start:frag.partition_start + frag.numel] = source[frag.param_start:
                                                                            frag.param_start + frag.numel]
    return out


def read_zero_states(path: str, files: dict[int, str]) -> list[dict]:
    """The ZeRO files of one (tensor rank, pipeline stage), {dp rank: file}, loaded in rank order."""
    if not files:
        raise CheckpointError(f"{path}: no {ZERO_FILES} files")
    if sorted(files) != list(range(len(files))):
        raise CheckpointError(f"{path}: ZeRO files for data-parallel ranks {sorted(files)}; some are missing")
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


def same_zero_layout(engine, state: dict, names: dict[int, str]) -> bool:
    """True when `state` (one rank's ZeRO file) was written by exactly this engine's partitioning."""
    saved = [g["layout"] for g in state["groups"]]
    return (state["dp_world_size"] == engine.dp_world_size
            and saved == [layout_meta(part.layout, names) for part in engine.dp.parts])


def load_own_zero_state(engine, state: dict) -> None:
    """Restore this rank's master partitions and optimizer state from its own file (same layout)."""
    engine.optimizer.load_state_dict(state["optimizer"])
    for part, group in zip(engine.dp.parts, state["groups"]):
        if group["master"].numel() != part.layout.partition_numel:
            raise CheckpointError(f"master partition of {group['master'].numel()} elements, expected "
                                  f"{part.layout.partition_numel}")
        load_master_partition(part, group["master"])
    engine.dp.update_model()
