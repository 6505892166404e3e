"""Which modules are ZeRO-3 units: every module owning parameters, merged by DeepSpeed's
stage3_module_granularity_threshold rule; a tied parameter belongs to its first owner."""

from __future__ import annotations

import torch.nn as nn

from megazero.config import parse_config
from megazero.zero.units import plan_units


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)  # 16 elements
        self.fc = nn.Linear(8, 8)  # 72 elements


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)  # 80 elements
        self.blocks = nn.ModuleList([Block(), Block()])
        self.seq = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied


def _names(model: nn.Module, threshold: int) -> list[tuple[str, int]]:
    names = {id(m): n for n, m in model.named_modules()}
    return [(names[id(u.module)], sum(p.numel() for p in u.params)) for u in plan_units(model, threshold)]


def test_every_module_owning_parameters_is_a_unit_by_default():
    model = Model()
    assert _names(model, 0) == [("embed", 80), ("blocks.0.norm", 16), ("blocks.0.fc", 72), ("blocks.1.norm", 16),
                                ("blocks.1.fc", 72), ("seq.0", 72), ("seq.2", 72)]  # head: only the tied weight


def test_granularity_threshold_merges_small_subtrees_but_not_containers():
    model = Model()
    # a Block averages (16 + 72) // 3 = 29 elements per module (norm, fc, itself): merged at 29, not at 28;
    # the ModuleList and the Sequential are containers, never merged as a whole
    assert _names(model, 28) == _names(model, 0)
    merged = [("embed", 80), ("blocks.0", 88), ("blocks.1", 88), ("seq.0", 72), ("seq.2", 72)]
    assert _names(model, 29) == merged
    assert _names(model, 42) == merged
    # the root: (80 + 2 * 88 + 144 + 80, the tied weight counted in both its modules as DeepSpeed
    # does) // 11 modules (the leaves, the 2 blocks, itself) = 43
    assert _names(model, 43) == [("", 400)]


def test_config_key_defaults_to_deepspeeds_zero():
    config = parse_config({"train_batch_size": 1, "zero_optimization": {"stage": 3}}, data_parallel_size=1)
    assert config.zero_optimization.stage3_module_granularity_threshold == 0
