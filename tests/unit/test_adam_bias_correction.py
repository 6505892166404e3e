"""Adam's `optimizer.params.bias_correction: false` (DeepSpeed's Adam has it): the moments are used
raw, equal to torch's formula without the correction, through the C++ op and the torch fallback."""

from __future__ import annotations

import pytest
import torch

from megazero.config import parse_config
from megazero.ops.builder import load_op
from megazero.ops.cpu_optimizers import FusedCPUAdam
from megazero.optim import build_optimizer

LR, BETAS, EPS, WD, STEPS = 1e-2, (0.9, 0.99), 1e-8, 0.1, 4


def _grads(shape=(5, 3)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for _ in range(STEPS)]


def _uncorrected(weight: torch.Tensor, grads: list[torch.Tensor], decoupled: bool) -> torch.Tensor:
    """Adam/AdamW written out, without dividing the moments by 1 - beta**step."""
    w, m, v = weight.double().clone(), torch.zeros_like(weight, dtype=torch.float64), None
    v = torch.zeros_like(w)
    for g in grads:
        g = g.double() + (0 if decoupled else WD * w)
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
        if decoupled:
            w = w * (1 - LR * WD)
        w = w - LR * m / (v.sqrt() + EPS)
    return w.float()


def _run(params: dict, grads: list[torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    p = torch.nn.Parameter(weight.clone())
    config = parse_config({"train_batch_size": 1, "optimizer": {"type": "Adam", "params": params}}, 1)
    optimizer = build_optimizer(config.optimizer, [p])
    for g in grads:
        p.grad = g.clone()
        optimizer.step()
    return p.detach(), optimizer


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("torch_adam", [False, True])
def test_no_bias_correction_matches_the_formula(decoupled, torch_adam):
    if not torch_adam and load_op("cpu_optimizers") is None:
        pytest.skip("the cpu_optimizers op could not be built")
    weight, grads = torch.randn(5, 3, generator=torch.Generator().manual_seed(1)), _grads()
    params = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD, "bias_correction": False,
              "adam_w_mode": decoupled, "torch_adam": torch_adam}
    got, optimizer = _run(params, grads, weight)
    assert isinstance(optimizer, FusedCPUAdam) and (optimizer.op is None) == torch_adam
    torch.testing.assert_close(got, _uncorrected(weight, grads, decoupled), rtol=1e-5, atol=1e-6)
    corrected, _ = _run({**params, "bias_correction": True}, grads, weight)
    assert not torch.allclose(corrected, got, atol=1e-4)  # the correction changes early steps a lot
