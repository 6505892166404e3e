"""How far the weights of a 16-bit run may lie from another run's: a tolerance derived from the
format's unit roundoff u (bf16: 2^-8, fp16: 2^-11), the learning rates and the optimizer (AdamW).

Per parameter tensor, with w the other run's final weights, w0 the common initial weights:

    ||w16 - w|| <= u ||w|| + 8 u ||w - w0||

- u ||w||: the compared weights are the 16-bit copies of the fp32 masters, each element rounded
  to nearest (relative error <= u).
- 8 u ||w - w0||: every gradient is a product of 16-bit operands, rounded at up to four points (an
  activation, a weight, the output gradient, the result), so it carries a relative error of up to
  4u. AdamW's step m/sqrt(v) is invariant to the gradient's scale, and a relative error e in the
  gradient changes it by up to 2e (e through m, e through sqrt(v)): each step's update, and so the
  drift w - w0 (the sum of the updates), is off by up to 8u of itself. The fp32 masters keep the
  16-bit roundings from compounding from step to step. 16-bit runs on different layouts differ
  only in where they round: the same bound holds.

One exception, the attention's key bias: its exact gradient is zero (softmax cancels the q . b_k
it adds to every score of a query), so what it receives is rounding noise in every format, and
Adam normalises noise into steps of up to lr. Only Adam's step bound applies there:
|w16 - w| <= u |w| + 2.1 sum_t lr_t (|m/sqrt(v)| <= 1.05 for beta1 = 0.9, beta2 = 0.999 and up to
10 steps; two runs each move that far).
"""

from __future__ import annotations

import torch

UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def warmup_lr_sum(max_lr: float, warmup_steps: int, steps: int) -> float:
    """Sum of the LRs of `steps` optimizer steps under a linear WarmupLR from 0 (step t: t/warmup of max)."""
    return sum(max_lr * min(t / warmup_steps, 1.0) for t in range(steps))


def _split_key_bias(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    if name.endswith("attn.qkv.bias"):  # [Q; K; V] rows
        q, k, v = tensor.chunk(3)
        return {f"{name}[q]": q, f"{name}[k]": k, f"{name}[v]": v}
    return {name: tensor}


def assert_weights_within_format(ours: dict, other: dict, initial: dict, fmt: str, lr_sum: float) -> None:
    """Every tensor of `ours` (a 16-bit run's weights) within the bound of the module docstring of
    `other`'s (same names, same initial weights `initial`)."""
    u = UNIT_ROUNDOFF[fmt]
    for name in initial:
        mine, theirs, start = (_split_key_bias(name, x[name].float()) for x in (ours, other, initial))
        for piece in start:
            diff = mine[piece] - theirs[piece]
            if piece.endswith("[k]"):
                bound = u * theirs[piece].abs() + 2.1 * lr_sum
                assert bool((diff.abs() <= bound).all()), (piece, diff.abs().max().item(), lr_sum)
                continue
            allowed = u * theirs[piece].norm() + 8 * u * (theirs[piece] - start[piece]).norm()
            assert diff.norm() <= allowed, (piece, fmt, diff.norm().item(), allowed.item())
