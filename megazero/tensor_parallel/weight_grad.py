"""Split backward for zero-bubble pipeline schedules: a linear layer's backward as B (the gradient of
its input, on the pipeline's critical path) and, later, W (the gradients of its weight and bias).

Outside `splittable()` `linear` is `F.linear` itself. Inside it, `linear` records a function with
one autograd edge, to its input: its backward computes the input gradient and, while
`deferring()` is active (a schedule's B), keeps what the weight gradient needs (the layer's input
and the output gradient) as one pending job in the `WeightGradients` store instead of computing it;
`STORE.run(key)` (the schedule's W) does the kept jobs, each accumulating into the parameters
through autograd (`torch.autograd.backward` on the leaves), so the hooks data parallelism registers
on parameters see them as they see any gradient. Outside `deferring()` the same backward runs the
job at once: the same operations on the same tensors, so B then W equals the fused backward bit
for bit, and both equal F.linear's own backward. (The parameters get no edge of their own:
autograd runs a parameter's accumulation, and its hooks, whenever an edge reaches it, even when
no gradient comes.)

Only weights that are leaves defer: a weight reached through another function (a tied or
replicated weight summed over the TP group by `sync_replicated_grad`) gets its gradient with B, as
does every layer that is not a `linear` (embeddings, norms, the MoE experts' batched matmuls): they
fall back to computing W with B. Column- and row-parallel layers defer theirs: their weight
gradients need no communication (the TP collectives are on the activations, in B).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megazero.profiling.memory import hold_for_backward

Job = Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]  # -> (parameter, its gradient) pairs


class WeightGradients:
    """The pending weight-gradient jobs of the B passes run under `deferring()`, in one list per
    key (a schedule's (chunk, micro-batch)); `run(key)` does them, oldest first, and hands all their
    gradients to autograd in one call."""

    def __init__(self):
        self.recording = False  # linear() builds splittable graphs (forwards of a zero-bubble schedule)
        self.key = None  # where a B under deferring() files its jobs; None: compute W with B
        self.pending: dict = {}

    def defer(self, job: Job) -> bool:
        """File `job` under the current key; False when no B is deferring (run it now)."""
        if self.key is None:
            return False
        self.pending.setdefault(self.key, []).append(job)
        return True

    def run(self, key) -> int:
        """Do the jobs filed under `key` (nothing filed: nothing to do); returns how many."""
        jobs = self.pending.pop(key, [])
        accumulate([pair for job in jobs for pair in job()])
        return len(jobs)

    def clear(self) -> None:
        """Drop every pending job (a step that failed part-way)."""
        self.pending.clear()


STORE = WeightGradients()


@contextlib.contextmanager
def splittable(enabled: bool = True):
    """Forwards inside build linear layers whose weight gradients can be deferred."""
    previous, STORE.recording = STORE.recording, enabled
    try:
        yield
    finally:
        STORE.recording = previous


@contextlib.contextmanager
def deferring(key):
    """Backward passes inside (a schedule's B) defer the weight gradients of splittable linear layers
    to STORE.run(key)."""
    previous, STORE.key = STORE.key, key
    try:
        yield
    finally:
        STORE.key = previous


def accumulate(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Add each gradient into its parameter through autograd (its accumulation and hooks run), one
    call for all; a parameter given twice (a layer run twice) gets the sum."""
    summed: dict[int, list] = {}
    for param, grad in pairs:
        if id(param) in summed:
            summed[id(param)][1] = summed[id(param)][1] + grad
        else:
            summed[id(param)] = [param, grad]
    if summed:
        torch.autograd.backward([p for p, _ in summed.values()], [g for _, g in summed.values()])


def _weight_grads(x: torch.Tensor, grad: torch.Tensor, has_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """F.linear's weight and bias gradients, by the operations its autograd uses (the same bits)."""
    x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
    return g2.t().mm(x2), (g2.sum(0) if has_bias else None)


class _SplittableLinear(torch.autograd.Function):
    """y = F.linear(x, weight, bias) with one autograd edge, to x: the parameters (`params`, passed
    beside their detached values) get their gradients from the job its backward files or runs."""

    @staticmethod
    def forward(ctx, x, weight, bias, params):
        ctx.save_for_backward(x, weight)
        ctx.params = params
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        leaf_weight, leaf_bias = ctx.params

        def job() -> list[tuple[torch.Tensor, torch.Tensor]]:
            grad_w, grad_b = _weight_grads(x, grad, leaf_bias is not None)
            return [(t, g) for t, g in ((leaf_weight, grad_w), (leaf_bias, grad_b))
                    if t is not None and t.requires_grad]

        if STORE.defer(job):
            hold_for_backward((x, grad), job)  # kept until the W: a schedule's activation memory
        else:
            accumulate(job())  # W with B (re-entrant: the parameters' accumulation and hooks run now)
        return grad_x, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; inside `splittable()`, one whose weight gradient a schedule's B may defer (for leaf
    parameters: a weight reached through another function keeps F.linear's backward)."""
    trains = weight.requires_grad or (bias is not None and bias.requires_grad)
    leaves = weight.grad_fn is None and (bias is None or bias.grad_fn is None)
    if not (STORE.recording and trains and leaves and torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    return _SplittableLinear.apply(x, weight.detach(), None if bias is None else bias.detach(), (weight, bias))
