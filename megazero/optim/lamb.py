"""LAMB (You et al., 2019) with DeepSpeed's parameters: Adam moments, a layer-wise trust ratio
||w|| / ||update|| clamped to [min_coeff, max_coeff]."""

from __future__ import annotations

import torch


class Lamb(torch.optim.Optimizer):
    """Layer-wise adaptive moments optimizer; a pure-torch reference implementation."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01):
        if lr < 0 or eps < 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"invalid Lamb hyper-parameters: lr={lr}, betas={betas}, eps={eps}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        """One LAMB update of every parameter that has a gradient."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                step = state["step"].item()
                grad = p.grad.float()
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if group["bias_correction"]:
                    m_hat = exp_avg / (1 - beta1 ** step)
                    v_hat = exp_avg_sq / (1 - beta2 ** step)
                else:
                    m_hat, v_hat = exp_avg, exp_avg_sq
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"] != 0:
                    update.add_(p.float(), alpha=group["weight_decay"])
                weight_norm = p.float().norm()
                update_norm = update.norm()
                if weight_norm > 0 and update_norm > 0:
                    trust = (weight_norm / update_norm).clamp(group["min_coeff"], group["max_coeff"]).item()
                else:
                    trust = 1.0
                p.add_(update.to(p.dtype), alpha=-group["lr"] * trust)
        return loss
