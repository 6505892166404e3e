"""The flat_partitions checkpoint format: what a partitioned state (ZeRO 1-3) writes per data-parallel
rank, and its re-cut to any other layout (the checkpoint half of megazero.zero.protocol).

Each data-parallel rank's file holds its fp32 master partitions, its optimizer state dict (over
those partitions) and the layout they follow (global parameter names and flat offsets, buckets
with their partition offsets, world size). Loading at the same layout reads the rank's own file;
otherwise every rank's file is read and each state tensor (master weights, Adam moments, ...) is
reassembled per parameter (export_flat_partitions) and cut again for the new layout
(PartitionCheckpoint.load_parameter_states).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from megazero.zero.layout import FlatLayout
from megazero.zero.master_partitions import load_master_partition, master_partition
from megazero.zero.protocol import (
    FLAT_PARTITIONS_FORMAT,
    ExportedParameterStates,
    optimizer_state,
    register_checkpoint_format,
)


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


def gather_partitions(meta: dict, partitions: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-parameter full tensors (shaped like the parameter) from every rank's partition of one group."""
    world = meta["world_size"]
    if len(partitions) != world:
        raise ValueError(f"expected {world} partitions, found {len(partitions)}")
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


def export_flat_partitions(saved: list[dict], module: dict[str, torch.Tensor]) -> ExportedParameterStates:
    """Whole per-parameter states from every data-parallel rank's file (rank order); ValueError when
    the files are not the whole set their writers made."""
    world = saved[0]["dp_world_size"]
    if len(saved) != world:
        raise ValueError(f"{len(saved)} ZeRO files, but they were written by {world} ranks")
    out = ExportedParameterStates()
    for part, states in zip(saved[0]["groups"], per_parameter_states(saved)):
        for name, tensor in states["master"].items():
            out.weights[name] = tensor.float()
            out.group_of[name] = part["group_index"]
            out.optimizer[name] = {**{k: v.clone() if torch.is_tensor(v) else v for k, v in states["_scalars"].items()},
                                   **{k: t[name] for k, t in states.items() if k not in ("master", "_scalars")}}
    out.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in saved[0]["optimizer"]["param_groups"]]
    return out


register_checkpoint_format(FLAT_PARTITIONS_FORMAT, export_flat_partitions)


class PartitionCheckpoint:
    """Mixin over `self.parts` (each with .masters, .layout, .group_index), `self.group`, `self.stage`
    and `self.world_size`: the checkpoint members of megazero.zero.protocol.DataParallelState."""

    checkpoint_format = FLAT_PARTITIONS_FORMAT
    state_partitioned = True
    export_parameter_states = staticmethod(export_flat_partitions)
    parts: list
    group: object
    stage: int
    world_size: int

    def parameter_shapes(self) -> dict[int, torch.Size]:
        """{id(param): shape} of every parameter in the layouts (recorded when they were built)."""
        return {id(p): part.layout.shapes[p] for part in self.parts for p in part.layout.params}

    def gathered(self, params: list[torch.nn.Parameter]) -> AbstractContextManager:
        """The parameters are whole already (stages 1-2: every rank holds the whole model)."""
        return nullcontext()

    def state_dict(self, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict:
        """This rank's master partitions, the optimizer's state over them, and their layouts."""
        return {
            "zero_stage": self.stage,
            "dp_world_size": self.world_size,
            "dp_rank": dist.get_rank(self.group),
            "optimizer": optimizer.state_dict(),
            "groups": [{"master": master_partition(part), "num_masters": len(part.masters),
                        "group_index": part.group_index, "layout": layout_meta(part.layout, names)}
                       for part in self.parts],
        }

    def same_layout(self, state: dict, names: dict[int, str]) -> bool:
        """True when `state` was written by exactly this partitioning (same world size and layouts)."""
        saved = [g["layout"] for g in state["groups"]]
        return (state["dp_world_size"] == self.world_size
                and saved == [layout_meta(part.layout, names) for part in self.parts])

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        """Restore this rank's master partitions and optimizer state (same layout); update the model."""
        optimizer.load_state_dict(state["optimizer"])
        for part, group in zip(self.parts, state["groups"]):
            if group["master"].numel() != part.layout.partition_numel:
                raise ValueError(f"master partition of {group['master'].numel()} elements, expected "
                                 f"{part.layout.partition_numel}")
            load_master_partition(part, group["master"])
        self.update_model()

    def load_parameter_states(self, optimizer: torch.optim.Optimizer, weights: dict[int, torch.Tensor],
                              states: dict[int, dict[str, Any]] | None, param_groups: list[dict]) -> None:
        """Cut this rank's partitions of the whole weights (and optimizer states); update the model."""
        rank = dist.get_rank(self.group)
        per_index, index = {}, 0
        for part in self.parts:
            load_master_partition(part, cut_partition(part.layout, rank, weights))
            if states is None:
                index += len(part.masters)
                continue
            params = part.layout.params
            keys = dict.fromkeys(k for p in params for k, v in states[id(p)].items() if _per_element(v))
            cut = {key: part.layout.split_partition(cut_partition(part.layout, rank, {
                id(p): states[id(p)][key] for p in params if key in states[id(p)]})) for key in keys}
            # per-tensor scalars (Adam's step) are the same for every parameter of a group
            first_scalars = {k: v for k, v in states[id(params[0])].items() if not _per_element(v)}
            for b in range(len(part.masters)):
                if cut or first_scalars:
                    entry = {k: v.clone() if torch.is_tensor(v) else v for k, v in first_scalars.items()}
                    per_index[index] = {**entry, **{k: v[b].clone() for k, v in cut.items()}}
                index += 1
        if states is not None:
            optimizer.load_state_dict(optimizer_state(optimizer, per_index, param_groups))
        self.update_model()


def _per_element(value) -> bool:
    """A state entry with one value per element of its parameter (not a scalar such as Adam's step)."""
    return torch.is_tensor(value) and value.dim() > 0
