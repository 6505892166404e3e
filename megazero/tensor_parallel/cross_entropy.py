"""Cross entropy over logits whose vocabulary dimension is split across the TP group.

No rank ever holds the whole [tokens, vocab] logits: the max, the target's logit and the sum of
exponentials are each all-reduced (three small collectives), and the gradient
softmax - one_hot(target) is formed locally on each rank's slice.

The vocabulary is padded so that it splits evenly (models/common.py); the padding columns are
masked to -inf here, so they take no probability mass and get exactly zero gradient. The loss is
then the same function at every padding, i.e. at every tensor-parallel size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _mask_padding(logits: torch.Tensor, start: int, vocab_size: int | None) -> torch.Tensor:
    """logits (this rank's columns start, start + 1, ...) with the columns >= vocab_size set to -inf."""
    if vocab_size is None or vocab_size >= start + logits.shape[-1]:
        return logits
    padding = torch.arange(start, start + logits.shape[-1], device=logits.device) >= vocab_size
    return logits.masked_fill(padding, float("-inf"))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, vocab_size: int | None):
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        per_rank = logits.shape[-1]
        start = rank * per_rank
        logits = _mask_padding(logits.float(), start, vocab_size)
        logits_max = logits.max(dim=-1).values  # -inf on a rank holding only padding: the MAX fixes it
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        outside = (target < start) | (target >= start + per_rank)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if world > 1:
            both = torch.stack([predicted, sum_exp])
            dist.all_reduce(both, group=group)
            predicted, sum_exp = both[0], both[1]
        loss = sum_exp.log() - predicted
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss (fp32, shaped like target) from this rank's vocabulary slice of the logits.

    vocab_size: the true vocabulary (targets must be below it); the columns from vocab_size up to
    the padded size are left out of the softmax. None: every column is a token.
    """
    if vocab_size is not None:
        world = dist.get_world_size(group) if group is not None else 1
        padded = logits.shape[-1] * world
        if not 0 < vocab_size <= padded:
            raise ValueError(f"vocab_size {vocab_size} must be in 1..{padded} (the logits' padded vocabulary: "
                             f"{logits.shape[-1]} columns x {world} tensor-parallel ranks)")
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size)
