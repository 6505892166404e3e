"""MoE auxiliary losses attached to the layers' output activations, with the main loss's gradient.

Added to the loss, an MoE layer's auxiliary losses would train only where the loss is: a
pipeline stage without the head sends hidden states on, and no term of its own reaches a
backward; a recomputed layer's forward runs without a graph. So each MoE layer built with
`attach_aux_loss` (megazero/moe/layer.py; GPT's and Llama's are) attaches them to its output, as
Megatron core's MoEAuxLossAutoScaler does:

    y = attach_aux_loss(y, aux)       # forward: y unchanged; backward: aux gets d(loss)/d(loss)

The gradient given to `aux` is the one the engine's backward gives the loss: the loss scale
times 1 / gradient_accumulation_steps (megazero.engine sets it around each backward with
`aux_loss_gradient_scale`; 1.0 outside one, as for a plain loss.backward(); a caller scaling
its loss itself must set it too). The auxiliary losses get exactly the gradient they would have
as terms of the loss, on every stage and under recomputation (the recomputed forward attaches
them again), and nothing is communicated. Their values are added to the value of the loss by
the model (megazero.moe.attached_aux_loss), and to the step's loss by the pipelined engine for
the model chunks without the loss.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_SCALE = [1.0]  # the current backward's gradient of the main loss w.r.t. itself (see the docstring)


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, aux):
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.aux_shape, _SCALE[0], dtype=ctx.aux_dtype, device=grad.device)


def attach_aux_loss(x: torch.Tensor, aux: torch.Tensor | float) -> torch.Tensor:
    """x, with the scalar loss `aux` made to receive, in x's backward, the main loss's gradient
    (a float aux, a model without MoE layers: x as it is)."""
    if not torch.is_tensor(aux):
        return x
    return _AttachAuxLoss.apply(x, aux)


@contextmanager
def aux_loss_gradient_scale(scale: float):
    """Within: attached auxiliary losses get gradient `scale` (loss scale / accumulation steps)."""
    previous, _SCALE[0] = _SCALE[0], float(scale)
    try:
        yield
    finally:
        _SCALE[0] = previous
