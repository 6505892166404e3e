"""ZeRO-3: what autograd saves for backward does not keep a released unit's gathered parameters in
memory. `nn.Linear` saves `weight.t()`, a view of the buffer the unit was gathered into; without
megazero.zero.saved_views every such buffer would live from its unit's forward to its backward (the
whole model at once). Checked on the buffers' storages themselves: once the forward has returned,
none of the gathered (non-persistent) buffers is alive, and the step that follows trains as usual."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

import megazero
from tests.training_helpers import base_config

WIDTH = 32


class _Model(nn.Module):
    """Three linear layers (2-D and 3-D inputs: F.linear saves weight.t() either way)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))).reshape(-1, WIDTH))
        return F.mse_loss(self.c(h), y)


def _gathered_buffers_after_forward() -> dict:
    megazero.set_seed(0)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 100, "reduce_bucket_size": 2000}
    config = base_config(train_batch_size=4, zero_optimization=zero)
    engine, _, _, _ = megazero.initialize(model=_Model(), config=config)
    buffers: list[weakref.ref] = []
    for layer in (engine.module.a, engine.module.b, engine.module.c):  # after the unit hooks: gathered here
        layer.register_forward_pre_hook(lambda m, args: buffers.append(weakref.ref(m.weight.untyped_storage())))
    gen = torch.Generator().manual_seed(engine.dp_rank)
    losses, alive = [], []
    for _ in range(2):
        loss = engine(torch.randn(2, 4, WIDTH, generator=gen), torch.randn(8, WIDTH, generator=gen))
        gc.collect()
        alive.append(sum(ref() is not None for ref in buffers))
        buffers.clear()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"alive": alive, "losses": losses}


def test_saved_views_do_not_keep_gathered_parameters(pools):
    for rank, result in enumerate(pools(2).run(_gathered_buffers_after_forward)):
        assert result["alive"] == [0, 0], f"rank {rank}: gathered buffers alive after forward: {result['alive']}"
        assert all(torch.isfinite(torch.tensor(result["losses"]))), result
