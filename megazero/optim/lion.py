"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of an
interpolated momentum, with decoupled weight decay; one state tensor per parameter.

Per step, with gradient g and momentum m (zero at the start):
    c = beta1 * m + (1 - beta1) * g
    w = w - lr * (sign(c) + weight_decay * w)
    m = beta2 * m + (1 - beta2) * g
The update has the same size lr in every coordinate, so the paper uses an lr 3-10x smaller
than AdamW's and a weight decay that much larger.
"""

from __future__ import annotations

import torch
from pydantic import Field

from megazero.config_fields import Betas, Float, Section


class LionParams(Section):
    """Lion: the sign of an interpolated momentum, decoupled weight decay."""

    lr: Float = Field(1e-4, ge=0, description="learning rate (the size of every coordinate's update)")
    betas: Betas = Field((0.9, 0.99), description="interpolation of the update (beta1), decay of the momentum (beta2)")
    weight_decay: Float = Field(0.0, ge=0, description="decoupled weight decay: w *= 1 - lr * weight_decay")


class Lion(torch.optim.Optimizer):
    """Lion in torch: `exp_avg` is the momentum m (torch's name, so state dicts read as Adam's)."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0):
        if lr < 0 or weight_decay < 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"invalid Lion hyper-parameters: lr={lr}, betas={betas}, weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        """One Lion update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                grad, exp_avg = p.grad, state["exp_avg"]
                update = exp_avg.mul(beta1).add_(grad, alpha=1 - beta1).sign_()
                if decay:  # decoupled: the decay does not enter the momentum
                    p.mul_(1 - lr * decay)
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
        return loss
