"""Write a checkpoint for another tensor/pipeline-parallel layout (scripts/convert_checkpoint.py).

The source is read per parameter (checkpoint.universal); each target (tensor rank, pipeline stage)
gets a model file and a ZeRO-0-format optimizer file holding its shards, with the engine state
(counters, LR schedule, loss scale, client state) copied. The result is marked `converted`, so an
engine of any data-parallel size and ZeRO stage loads it through the per-parameter path. Where the
target pads the vocabulary differently, padding rows are added (zeros) or dropped first
(checkpoint.universal.fit_vocabulary_rows), so every file holds the target's own shapes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megazero.checkpoint.files import model_file, optim_file
from megazero.checkpoint.io import CheckpointError, atomic_checkpoint_dir, save_file
from megazero.checkpoint.universal import ParameterStates, fit_vocabulary_rows, saved_vocab_size
from megazero.tensor_parallel.utils import shard_of


@dataclass
class StageParameter:
    """One parameter of a target pipeline stage: global name, partition dimension (None when every
    tensor rank holds it whole), stride, and the whole tensor's rows in the target (None: as saved;
    they differ from the saved ones only by vocabulary padding)."""

    name: str
    partition_dim: int | None
    stride: int = 1
    rows: int | None = None


def _shard(value, param: StageParameter, tp: int, tp_rank: int, vocab_size: int | None):
    if not torch.is_tensor(value) or value.dim() == 0:
        return value
    if param.rows is not None:
        value = fit_vocabulary_rows(value, param.rows, param.name, vocab_size)
    if param.partition_dim is None or tp == 1:
        return value
    return shard_of(value, param.partition_dim, tp, tp_rank, param.stride)


def write_converted(states: ParameterStates, save_dir: str, tag: str, stages: list[list[StageParameter]], tp: int,
                    model_config: dict | None = None) -> str:
    """Write `states` as a (tp x len(stages)) checkpoint under save_dir/tag; returns its directory."""
    pp = len(stages)
    wanted = {p.name for stage in stages for p in stage}
    missing = sorted(wanted - set(states.weights))
    if missing:
        raise CheckpointError(f"the source checkpoint lacks parameters {missing[:5]} (of {len(missing)})")
    extra = sorted(set(states.weights) - wanted)
    if extra:
        raise CheckpointError(f"the target layout has no place for parameters {extra[:5]} (of {len(extra)})")
    buffers = {k: v for k, v in states.module.items() if k not in states.weights}
    vocab = saved_vocab_size(states)
    with atomic_checkpoint_dir(save_dir, tag) as tmp:
        for pp_rank, stage in enumerate(stages):
            by_group = sorted(stage, key=lambda p: states.group_of[p.name])  # stable: module order per group
            for tp_rank in range(tp):
                weights = [_shard(states.weights[p.name], p, tp, tp_rank, vocab) for p in by_group]
                save_file({
                    **{k: v for k, v in states.engine.items() if k not in ("module", "param_meta")},
                    "module": {**{p.name: _shard(states.weights[p.name], p, tp, tp_rank, vocab) for p in stage},
                               **buffers},
                    "layout": {"tp": tp, "pp": pp, "dp": 1, "zero_stage": 0, "tp_rank": tp_rank, "pp_rank": pp_rank},
                    "dp_world_size": 1, "zero_stage": 0, "converted": True,
                    "param_meta": {p.name: [p.partition_dim, p.stride] for p in stage},
                    "model_config": model_config if model_config is not None else states.engine.get("model_config"),
                }, os.path.join(tmp, model_file(tp_rank, pp_rank, pp)))
                optimizer = {"state": {i: {k: _shard(v, p, tp, tp_rank, vocab)
                                           for k, v in states.optimizer[p.name].items()}
                                       for i, p in enumerate(by_group)},
                             "param_groups": [{**hyper, "params": [i for i, p in enumerate(by_group)
                                                                   if states.group_of[p.name] == gi]}
                                              for gi, hyper in enumerate(states.param_groups)]}
                save_file({"optimizer": optimizer, "param_names": [p.name for p in by_group], "master_params": weights},
                          os.path.join(tmp, optim_file(tp_rank, pp_rank, pp)))
    return os.path.join(save_dir, tag)
