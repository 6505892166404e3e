"""What the engine may ask of an optimizer, beyond `torch.optim.Optimizer` itself.

The engine steps any torch optimizer over the fp32 master weights. Two capabilities make that
step one pass over memory; an optimizer opts in to each by having its members (the protocols
below), and the engine asks through `takes_grad_scale` and `writes_copies`, nothing else:

- `GradScaleTaker`: the optimizer divides every gradient by `grad_scale` inside step(). The
  engine steps it through `step_with_grad_scale` (the divisor: loss scale times the clipping
  factor), which sets it just before step() and resets it to None after; None means 1. Without
  it, the engine first multiplies the gradients by 1 / divisor in a separate pass. torch's own
  fused Adam/AdamW (`fused=True`) reads `grad_scale` the same way without declaring it: it counts
  too, and gets the attribute for the one step only, as torch's GradScaler gives it.
- `CopyTargetWriter`: set_copy_targets({id(master): tensor16}) once, at engine start-up; each
  step() then writes every updated master into its bf16/fp16 tensor (round to nearest even), so
  the engine skips its cast pass. The engine calls it only when every master has a target.

megazero's fused CPU/CUDA optimizers (megazero.ops) implement both; a new optimizer needs
neither (Lion has neither: the engine unscales its gradients and casts its copies).

Two more let an optimizer communicate itself (the 1-bit optimizers, megazero.optim.onebit):
- `DataParallelAverager`: the engine hands it the data-parallel group once (bind_data_parallel)
  and, before each accumulation window, asks `local_gradients`: when true the engine's
  data-parallel state (ZeRO stage 0 only) neither reduces nor averages that window's gradients,
  and step() averages what it needs over the group (a compressed momentum); the gradient norm is
  then each rank's own, and an inf/nan on any rank skips the step everywhere.
- `RankLocalState`: state that differs between data-parallel ranks (compression errors). The
  checkpoint writes it per rank and restores it at the same layout; at another layout, or when
  the optimizer states are not loaded, load_rank_state_dict(None) resets it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class GradScaleTaker(Protocol):
    """An optimizer whose step() divides the gradients by `grad_scale` (None: no division)."""

    grad_scale: torch.Tensor | float | None


@runtime_checkable
class CopyTargetWriter(Protocol):
    """An optimizer whose step() also writes each updated master into its 16-bit copy."""

    def set_copy_targets(self, copies: dict[int, torch.Tensor]) -> None:
        """{id(master parameter): 16-bit tensor} to be written with each updated master."""


@runtime_checkable
class DataParallelAverager(Protocol):
    """An optimizer that averages over the data-parallel group itself while `local_gradients` is true."""

    local_gradients: bool

    def bind_data_parallel(self, group) -> None:
        """The data-parallel process group its step() communicates over (None: the default group)."""


@runtime_checkable
class RankLocalState(Protocol):
    """An optimizer with state of its own on each data-parallel rank, saved per rank."""

    def rank_state_dict(self) -> dict:
        """This rank's own state (tensors and plain values)."""

    def load_rank_state_dict(self, state: dict | None) -> None:
        """Restore rank_state_dict()'s output; None: start that state afresh."""


def takes_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """True when the engine may hand the unscale/clip divisor to step() as `grad_scale`."""
    if isinstance(optimizer, GradScaleTaker):
        return True
    # torch's fused Adam/AdamW take `grad_scale` by the same convention, without declaring it
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and bool(optimizer.defaults.get("fused"))


def step_with_grad_scale(optimizer: torch.optim.Optimizer, grad_scale: float | None) -> None:
    """optimizer.step() with every gradient divided by `grad_scale` (None: 1) inside its own pass;
    for an optimizer that takes_grad_scale(). A GradScaleTaker gets a float, rounded to fp32 as a
    tensor would be (a tensor on the GPU would be read back: a host sync), reset to None after.
    torch's fused Adam gets a 0-dim fp32 tensor on its parameters' device (a fill kernel: no copy
    to wait for), deleted after: it never turns into a GradScaleTaker."""
    if grad_scale is None:
        optimizer.step()
        return
    if isinstance(optimizer, GradScaleTaker):
        optimizer.grad_scale = torch.tensor(grad_scale, dtype=torch.float32).item()
        try:
            optimizer.step()
        finally:
            optimizer.grad_scale = None
        return
    device = optimizer.param_groups[0]["params"][0].device
    optimizer.grad_scale = torch.full((), grad_scale, dtype=torch.float32, device=device)
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale


def writes_copies(optimizer: torch.optim.Optimizer) -> bool:
    """True when step() can write the 16-bit model copies (see `CopyTargetWriter`)."""
    return isinstance(optimizer, CopyTargetWriter)
