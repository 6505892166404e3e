"""Runaway numerics: the error that stops a run whose optimizer steps keep being skipped.

A step is skipped when its global gradient norm is inf/nan: an fp16 loss-scale overflow, or a
diverged run in any precision, or a forward loss that was already inf/nan (the engine multiplies
the scaled loss by nan then, so that every gradient, and with it the global norm, is non-finite on
every rank). After `max_consecutive_skipped_steps` such steps in a row the engine raises
:class:`NumericsError` on every rank, with one message: the step, the loss scale, the first
parameter with a non-finite gradient and the ranks whose forward loss was non-finite.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class NumericsError(RuntimeError):
    """Too many consecutive optimizer steps were skipped for inf/nan gradients or losses."""


def loss_guard(loss: torch.Tensor) -> torch.Tensor:
    """1.0 where the forward loss is finite and nan where it is not, a scalar on its device with no
    host sync (loss * 0 + 1: inf * 0 and nan * 0 are nan; two scalar kernels, cheaper than isfinite
    and where). Multiplying the scaled loss by it leaves a finite loss's gradients bit for bit as
    they were and makes a non-finite loss poison all of them (an inf loss of finite gradients, e.g.
    loss + inf, would otherwise be stepped on)."""
    value = loss.detach().float()
    return ((value if value.dim() == 0 else value.sum()) * 0.0).add_(1.0)


def _gather(value: dict, group) -> list[dict]:
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _scale_kind(engine) -> str:
    scaler = engine.loss_scaler
    if engine.config.fp16.enabled and scaler.dynamic:
        floor = " (at min_loss_scale: a loss-scale collapse)" if scaler.scale <= scaler.min_scale else ""
        return f"{scaler.scale:g}, fp16 dynamic{floor}"
    if engine.config.fp16.enabled:
        return f"{scaler.scale:g}, fp16 static"
    return f"{scaler.scale:g}, {str(engine.config.compute_dtype).replace('torch.', '')} (no loss scaling)"


def numerics_error(engine, grad_norm: float, loss_guards: list[torch.Tensor]) -> NumericsError:
    """The error for the step that reached the limit. Collective (one all_gather_object over the
    engine's ranks; called on every rank, which all reach the limit at the same step because the
    overflow test is global), so that every rank raises the same message; call it before the
    gradients are discarded. `loss_guards`: this rank's loss_guard() values, one per backward of the step."""
    module = engine.module
    rename = getattr(module, "global_parameter_name", None)
    order = {id(p): (index, rename(name) if rename else name)
             for index, (name, p) in enumerate(module.named_parameters())}
    bad = sorted({order[id(p)] for p in engine.dp.nonfinite_params() if id(p) in order})
    stage = engine.grid.pp_rank if engine.grid is not None else 0
    mine = {"rank": engine.global_rank, "stage": stage, "params": bad,
            "bad_losses": [m for m, guard in enumerate(loss_guards) if bool(guard.isnan())],  # failure path only
            "names": [name for _, name in order.values()]}
    # with a grid every rank of the job takes part in the step; without one, the data-parallel group
    everyone = _gather(mine, None if engine.grid is not None else engine.dp_group)

    step = engine.global_steps + 1
    count, limit = engine.consecutive_skipped_steps, engine.config.max_consecutive_skipped_steps
    candidates = sorted((r["stage"], index, name) for r in everyone for index, name in r["params"])
    names = {name for _, _, name in candidates}
    total = len({name for r in everyone for name in r["names"]})  # tied copies on two stages count once
    if candidates:
        where = (f"first parameter with a non-finite gradient: {candidates[0][2]} "
                 f"({len(names)} of {total} parameters have one)")
    else:
        where = ("no gradient element is inf/nan: the gradient norm itself overflowed "
                 "(gradients too large to square in fp32)")
    losses = [f"rank {r['rank']} micro-batch {', '.join(map(str, r['bad_losses']))}"
              for r in everyone if r["bad_losses"]]
    loss_note = (f"; the forward loss was already inf/nan (found before backward) on {'; '.join(losses)}"
                 if losses else "")
    first = step - count + 1
    steps = f"steps {first}-{step}" if count > 1 else f"step {step}"
    return NumericsError(
        f"step {step}: {count} consecutive optimizer steps skipped ({steps}; max_consecutive_skipped_steps = "
        f"{limit}); the last had gradient norm {grad_norm}; loss scale {_scale_kind(engine)}; {where}{loss_note}. "
        f"The weights are those after step {first - 1}. Lower the learning rate, check the data of these steps, "
        f"or raise max_consecutive_skipped_steps (0 = never stop)")
