"""Lion against the paper's update rule (Chen et al. 2023, Algorithm 2), written out by hand here:
c = b1*m + (1-b1)*g;  w = w - lr*(sign(c) + wd*w);  m = b2*m + (1-b2)*g."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from megazero.optim.lion import Lion, LionParams

STEPS = 8


def _paper_rule(w: list[float], grads: list[list[float]], lr: float, b1: float, b2: float, wd: float) -> list[float]:
    """The update rule in plain Python floats (double precision), one coordinate at a time."""
    w, m = list(w), [0.0] * len(w)
    for g in grads:
        for i in range(len(w)):
            c = b1 * m[i] + (1 - b1) * g[i]
            sign = (c > 0) - (c < 0)
            w[i] = w[i] - lr * (sign + wd * w[i])
            m[i] = b2 * m[i] + (1 - b2) * g[i]
    return w


@pytest.mark.parametrize("wd", [0.0, 0.5])
def test_lion_follows_the_paper(wd):
    torch.manual_seed(0)
    n, lr, b1, b2 = 37, 0.01, 0.9, 0.99
    start = torch.randn(n, dtype=torch.float64)
    # gradients whose sign changes from step to step, so the interpolation c (not g) decides the sign
    grads = [torch.randn(n, dtype=torch.float64) * (1 + step) for step in range(STEPS)]
    p = torch.nn.Parameter(start.clone())
    opt = Lion([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    expected = _paper_rule(start.tolist(), [g.tolist() for g in grads], lr, b1, b2, wd)
    torch.testing.assert_close(p.detach(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    m = torch.zeros(n, dtype=torch.float64)
    for g in grads:
        m = b2 * m + (1 - b2) * g
    torch.testing.assert_close(opt.state[p]["exp_avg"], m, rtol=0, atol=1e-12)


def test_lion_fp32_within_its_roundoff_of_the_paper():
    """fp32 weights: each step rounds w twice (the decay, the signed step), each by at most half an
    ulp, 2^-24 |w|; 8 steps stay within that of the rule in double precision."""
    torch.manual_seed(1)
    n, lr, b1, b2, wd = 101, 1e-3, 0.95, 0.98, 0.1
    start = torch.rand(n) - 0.5
    grads = [torch.randn(n) for _ in range(STEPS)]
    p = torch.nn.Parameter(start.clone())
    opt = Lion([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    expected = torch.tensor(_paper_rule(start.double().tolist(), [g.double().tolist() for g in grads], lr, b1, b2,
                                        wd), dtype=torch.float64)
    bound = 2 * STEPS * 2.0**-24 * float(expected.abs().max())
    torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=bound)


def test_lion_skips_params_without_gradients_and_keeps_its_state_dict():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = Lion([a, b], lr=0.1)
    a.grad = torch.tensor([1.0, -2.0, 0.0])
    opt.step()
    torch.testing.assert_close(a.detach(), torch.tensor([0.9, 1.1, 1.0]), rtol=0, atol=1e-7)  # sign(0) = 0
    assert torch.equal(b.detach(), torch.ones(3))
    restored = Lion([a, b], lr=0.1)
    restored.load_state_dict(opt.state_dict())
    assert torch.equal(restored.state[a]["exp_avg"], opt.state[a]["exp_avg"]) and b not in restored.state


def test_lion_hyper_parameters_are_checked():
    with pytest.raises(ValueError, match="invalid Lion hyper-parameters"):
        Lion([torch.nn.Parameter(torch.zeros(1))], betas=(0.9, 1.0))
    assert LionParams().model_dump() == {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0}
    with pytest.raises(ValidationError, match="betas"):
        LionParams(betas=[0.9])
    with pytest.raises(ValidationError, match="weight_decay"):
        LionParams(weight_decay=-1.0)
