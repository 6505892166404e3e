"""Fused CPU optimizers (Adam/AdamW, LAMB, Adagrad) over fp32 master weights, backed by the C++ op
`cpu_optimizers` (csrc/cpu_optimizers.cpp), with a pure-torch reference of the same arithmetic that
tests compare against and that runs whenever the op cannot be built.

Two things make the engine's optimizer phase one pass over memory (the protocol in
megazero.optim.protocol):
- `grad_scale` (a tensor or float attribute, as torch's fused Adam has): gradients are divided by
  it inside the update (loss-scale unscaling and clipping), not in a separate pass;
- `set_copy_targets({id(master): tensor16})`: after updating a master, the op writes its bf16/fp16
  working copy in the same loop, so no separate cast pass is needed.
State dicts use torch's names (`step`, `exp_avg`, `exp_avg_sq`; Adagrad's `sum`). The reference
path (`use_op=False`) runs on fp32 tensors of any device; it is the registry's pure-torch Lamb.
"""

from __future__ import annotations

import math

import torch

from megazero.ops.builder import load_op


def cpu_optimizers_op():
    """The compiled op, or None (the reference path is then used)."""
    return load_op("cpu_optimizers")


class _FusedCPUOptimizer(torch.optim.Optimizer):
    """What the three optimizers share: grad_scale, the 16-bit copies, op-or-reference dispatch."""

    state_keys: tuple[str, ...] = ()

    def __init__(self, params, defaults: dict, use_op: bool | None = None):
        super().__init__(params, defaults)
        self.grad_scale: torch.Tensor | float | None = None
        self._copies: dict[int, torch.Tensor] = {}
        self._use_op = use_op

    def _check_param(self, p: torch.Tensor) -> None:
        on_cpu = self._use_op is not False  # the op reads CPU memory; the reference is torch on any device
        if p.dtype != torch.float32 or (on_cpu and p.device.type != "cpu"):
            raise TypeError(f"{type(self).__name__} updates fp32{' CPU' if on_cpu else ''} tensors, "
                            f"got {p.dtype} on {p.device}")

    def set_copy_targets(self, copies: dict[int, torch.Tensor]) -> None:
        """{id(master parameter): 16-bit tensor} to be written with each updated master."""
        self._copies = dict(copies)

    @property
    def op(self):
        """The C++ op when it is to be used (None: the reference)."""
        if self._use_op is False:
            return None
        op = cpu_optimizers_op()
        if op is None and self._use_op:
            raise RuntimeError("the cpu_optimizers op was requested (use_op=True) but could not be built")
        return op

    def _scale(self) -> float:
        scale = self.grad_scale
        return 1.0 if scale is None else float(scale)

    def _gather(self, group: dict):
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            self._check_param(p)
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                for key in self.state_keys:
                    state[key] = torch.full_like(p, self._initial_state(group), memory_format=torch.contiguous_format)
        copies = [self._copies.get(id(p)) for p in params]
        with_copies = bool(params) and all(c is not None for c in copies)
        return params, (copies if with_copies else None)

    def _initial_state(self, group: dict) -> float:
        return 0.0

    def _write_copies(self, params, copies) -> None:
        """Reference path: the 16-bit copies, as the op writes them (round to nearest even)."""
        if copies is not None:
            for p, c in zip(params, copies):
                c.copy_(p.view_as(c))

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params, copies = self._gather(group)
            if not params:
                continue
            for p in params:
                self.state[p]["step"] += 1
            step = int(self.state[params[0]]["step"].item())
            grads = [p.grad.contiguous() for p in params]
            if self.op is not None:
                self._op_step(group, params, grads, copies, step)
            else:
                self._reference_step(group, params, grads, step)
                self._write_copies(params, copies)
        return loss


class FusedCPUAdam(_FusedCPUOptimizer):
    """Adam with DeepSpeed's `adamw_mode` (True: decoupled weight decay, AdamW; False: L2 added to
    the gradient) and `bias_correction`. Matches torch.optim.Adam / AdamW."""

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 adamw_mode: bool = True, bias_correction: bool = True, use_op: bool | None = None):
        if lr < 0 or eps < 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"invalid Adam hyper-parameters: lr={lr}, betas={betas}, eps={eps}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      adamw_mode=adamw_mode, bias_correction=bias_correction), use_op)

    def _op_step(self, group, params, grads, copies, step: int) -> None:
        beta1, beta2 = group["betas"]
        self.op.adam_step(params, grads, [self.state[p]["exp_avg"] for p in params],
                          [self.state[p]["exp_avg_sq"] for p in params], copies, group["lr"], beta1, beta2,
                          group["eps"], group["weight_decay"], step, group["adamw_mode"], group["bias_correction"],
                          self._scale())

    def _reference_step(self, group, params, grads, step: int) -> None:
        beta1, beta2 = group["betas"]
        lr, wd, scale = group["lr"], group["weight_decay"], self._scale()
        bias1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
        bias2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
        for p, g in zip(params, grads):
            state = self.state[p]
            grad = g.float() / scale
            if not group["adamw_mode"] and wd:
                grad = grad + wd * p
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if group["adamw_mode"] and wd:
                p.mul_(1 - lr * wd)
            denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias2)).add_(group["eps"])
            p.addcdiv_(state["exp_avg"], denom, value=-lr / bias1)


class FusedCPULamb(_FusedCPUOptimizer):
    """LAMB with DeepSpeed's parameters (trust ratio ||w|| / ||update|| per tensor, clamped to
    [min_coeff, max_coeff]); with use_op=False, megazero's pure-torch LAMB."""

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 use_op: bool | None = None):
        if lr < 0 or eps < 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"invalid Lamb hyper-parameters: lr={lr}, betas={betas}, eps={eps}")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, max_coeff=max_coeff, min_coeff=min_coeff), use_op)

    def _op_step(self, group, params, grads, copies, step: int) -> None:
        beta1, beta2 = group["betas"]
        self.op.lamb_step(params, grads, [self.state[p]["exp_avg"] for p in params],
                          [self.state[p]["exp_avg_sq"] for p in params], copies, group["lr"], beta1, beta2,
                          group["eps"], group["weight_decay"], step, group["bias_correction"], group["max_coeff"],
                          group["min_coeff"], self._scale())

    def _reference_step(self, group, params, grads, step: int) -> None:
        beta1, beta2 = group["betas"]
        bias1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
        bias2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
        for p, g in zip(params, grads):
            state = self.state[p]
            grad = g.float() / self._scale()
            state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            update = (state["exp_avg"] / bias1) / ((state["exp_avg_sq"] / bias2).sqrt() + group["eps"])
            update.add_(p, alpha=group["weight_decay"])
            w_norm, u_norm = p.norm().item(), update.norm().item()
            trust = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"]) if w_norm > 0 and u_norm > 0 \
                else 1.0
            p.add_(update, alpha=-group["lr"] * trust)


class FusedCPUAdagrad(_FusedCPUOptimizer):
    """Adagrad (torch.optim.Adagrad's semantics: lr_decay, initial_accumulator_value, L2 weight decay)."""

    state_keys = ("sum",)

    def __init__(self, params, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, use_op: bool | None = None):
        if lr < 0 or eps < 0 or lr_decay < 0 or initial_accumulator_value < 0:
            raise ValueError(f"invalid Adagrad hyper-parameters: lr={lr}, lr_decay={lr_decay}, eps={eps}")
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, eps=eps), use_op)

    def _initial_state(self, group: dict) -> float:
        return group["initial_accumulator_value"]

    def _op_step(self, group, params, grads, copies, step: int) -> None:
        self.op.adagrad_step(params, grads, [self.state[p]["sum"] for p in params], copies, group["lr"],
                             group["lr_decay"], group["eps"], group["weight_decay"], step, self._scale())

    def _reference_step(self, group, params, grads, step: int) -> None:
        clr = group["lr"] / (1 + (step - 1) * group["lr_decay"])
        for p, g in zip(params, grads):
            grad = g.float() / self._scale() + group["weight_decay"] * p
            state_sum = self.state[p]["sum"]
            state_sum.addcmul_(grad, grad, value=1)
            p.addcdiv_(grad, state_sum.sqrt().add_(group["eps"]), value=-clr)


def grad_norm_squared(tensors: list[torch.Tensor]) -> float:
    """Sum of squares of CPU fp32/bf16 tensors in one pass (inf/nan propagate); the op's blocked
    summation does not depend on the thread count. Reference: torch's vector norm."""
    op = cpu_optimizers_op()
    if op is not None and all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16)
                              for t in tensors):
        total, _ = op.grad_norm_squared([t.contiguous() for t in tensors])
        return total
    return sum(float(torch.linalg.vector_norm(t.float())) ** 2 for t in tensors)
