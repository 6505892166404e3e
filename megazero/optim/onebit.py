"""The compressed-communication optimizers: 1-bit Adam, 0/1 Adam and 1-bit LAMB (DeepSpeed's
OneBitAdam / OnebitAdam, ZeroOneAdam and OneBitLamb, with their parameters).

Each starts as its plain counterpart (megazero's Adam or LAMB, the very same update, so a run
equals Adam's or LAMB's step for step) on gradients the engine all-reduces. Then the engine
keeps the gradients local (megazero.optim.protocol.DataParallelAverager) and the optimizer
averages a 1-bit compressed tensor over the data-parallel group instead
(megazero.optim.compression: a sign per element, a scale per 2,048-element block, error feedback):
- 1-bit Adam (Tang et al. 2021): after `freeze_step` steps the variance is frozen and the
  momentum, updated with the local gradient, is what is compressed and averaged.
- 0/1 Adam (Lu et al. 2022): the variance is updated only on steps whose gradients are
  all-reduced in full, at intervals that double after every `var_update_scaler` updates; the other
  steps average a compressed gradient. After `var_freeze_step` the variance is frozen and ranks
  take local steps, synchronising (compressed) the learning-rate-weighted momentum they
  accumulated every `local_step_interval` steps, an interval that doubles after every
  `local_step_scaler` steps up to `local_step_clipper`.
- 1-bit LAMB (Li et al. 2021): the warm-up is LAMB, keeping a moving average of each tensor's trust
  ratio; after `freeze_step` the momenta are compressed and averaged as 1-bit Adam's, and each
  tensor's frozen trust ratio is adapted by how far a fresh variance estimate (from the averaged
  momenta) drifts from the frozen one.

What is compressed is divided by the variance's denominator first (sqrt(v) + eps, the same on
every rank and fixed between variance updates, so without compression the average would be the
same): in that preconditioned space every coordinate is on Adam's update scale, so one scale per
block fits all of its elements. The papers compress the raw momentum (gradient), whose magnitudes
within one tensor differ by orders: a key bias's momentum is rounding noise (softmax cancels its
gradient), and the block's scale, divided by its tiny sqrt(v), made updates 10^3-10^4 times Adam's
and a GPT diverge (benchmarks/bench_onebit.py). The preconditioned values are clamped to Adam's
own bound on |m| / sqrt(v) (momentum_bound): with the variance frozen, a rare token's embedding row
meets a stale, tiny variance, and one such value would set its whole block's scale. Coordinates
whose variance is exactly zero (no gradient yet, such as padded vocabulary rows) are left out of
the compression, as DeepSpeed's `exp_avg_mask` leaves them out by hand: their average is zero.

As in DeepSpeed: the update adds `weight_decay` decoupled (AdamW's form), the moments are never
bias-corrected (`bias_correction` is accepted and has no effect, as there), ZeRO stages 1-3 are
refused. Unlike DeepSpeed: the first step updates the weights (DeepSpeed's only initialises), and
the compression errors are saved per rank and restored at the same layout (DeepSpeed resets them).
`comm_backend_name` and `cuda_aware` name DeepSpeed's NCCL/MPI backends; megazero communicates over
the engine's data-parallel group with what is fast on its backend, so they have no effect.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from pydantic import Field, model_validator

from megazero.config_fields import Betas, Bool, Float, Int, Section, Str
from megazero.ops.cpu_optimizers import FusedCPUAdam, FusedCPULamb
from megazero.optim.compression import BlockLayout, CompressedAllReduce

_NO_EFFECT = "accepted without effect: megazero communicates over the engine's data-parallel group (gloo or NCCL)"


class _OneBitParams(Section):
    """What the three share: Adam's moments, decoupled weight decay, DeepSpeed's backend keys."""

    lr: Float = Field(1e-3, ge=0, description="learning rate")
    betas: Betas = Field((0.9, 0.999), description="decay rates of the first and second moments")
    eps: Float = Field(1e-8, ge=0, description="added to the second moment's square root")
    weight_decay: Float = Field(0.0, ge=0, description="decoupled weight decay (added to the update, as AdamW)")
    bias_correction: Bool = Field(False, description="accepted without effect: the moments are never "
                                                     "bias-corrected (DeepSpeed ignores it too)")
    cuda_aware: Bool = Field(False, description=f"DeepSpeed's CUDA-aware MPI switch; {_NO_EFFECT}")
    comm_backend_name: Str = Field("nccl", description=f"DeepSpeed's compressed backend (nccl, mpi, ...); "
                                                       f"{_NO_EFFECT}")

    @model_validator(mode="after")
    def _warn_backend_keys(self) -> _OneBitParams:
        for key in sorted({"cuda_aware", "comm_backend_name"} & self.model_fields_set):
            warnings.warn(f"config key 'optimizer.params.{key}' has no effect in megazero: {_NO_EFFECT}", stacklevel=2)
        return self


class OneBitAdamParams(_OneBitParams):
    """1-bit Adam: Adam for `freeze_step` steps, then a frozen variance and a compressed momentum."""

    freeze_step: Int = Field(100000, ge=1, description="steps of plain Adam (all-reduced gradients) before "
                                                       "the momentum is compressed (at least 1: the variance "
                                                       "it freezes)")


class ZeroOneAdamParams(_OneBitParams):
    """0/1 Adam: variance updates at doubling intervals, compressed gradients, then local steps."""

    var_freeze_step: Int = Field(100000, ge=0, description="the variance is frozen after it: local steps from "
                                                           "step var_freeze_step + 2 (DeepSpeed's counting)")
    var_update_scaler: Int = Field(16, ge=1, description="variance updates per interval; the interval between "
                                                         "them then doubles")
    local_step_scaler: Int = Field(32678, ge=1, description="local steps per interval; the interval between "
                                                            "synchronisations then doubles")
    local_step_clipper: Int = Field(16, ge=1, description="the longest interval between synchronisations")


class OneBitLambParams(_OneBitParams):
    """1-bit LAMB: LAMB for `freeze_step` steps, then compressed momenta and frozen trust ratios."""

    freeze_step: Int = Field(100000, ge=1, description="steps of plain LAMB before the momenta are compressed "
                                                       "(at least 1: the variance it freezes)")
    max_coeff: Float = Field(10.0, gt=0, description="upper clamp of the trust ratio")
    min_coeff: Float = Field(0.01, ge=0, description="lower clamp of the trust ratio")
    coeff_beta: Float = Field(0.9, ge=0, lt=1, description="decay of the trust ratio's moving average (warm-up)")
    factor_max: Float = Field(4.0, gt=0, description="upper clamp of the frozen trust ratio's scaling factor")
    factor_min: Float = Field(0.5, ge=0, description="lower clamp of the frozen trust ratio's scaling factor")
    factor_threshold: Float = Field(0.1, ge=0, description="largest relative change of that factor per step")


class _Compressing:
    """What the three share: the data-parallel group, one flat buffer in a BlockLayout over every
    parameter (what is compressed), its CompressedAllReduce, the frozen denominators and the
    per-rank state protocol."""

    def _init_compressing(self, bias_correction: bool) -> None:
        if bias_correction:
            warnings.warn(f"{type(self).__name__}: 'bias_correction' true has no effect: the moments are never "
                          f"bias-corrected (DeepSpeed's implementation ignores it too)", stacklevel=4)
        self._dp_group = None
        self._averager: CompressedAllReduce | None = None
        self._flat: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._pending_rank_state: dict | None = None
        # sqrt(v) + eps per parameter while the variance stays (cleared whenever it changes), and
        # whether the excluded zero-variance positions must be found again
        self._denominators: dict[torch.Tensor, torch.Tensor] = {}
        self._zero_variance_stale = True
        self._announced: set[str] = set()

    def _announce(self, phase: str) -> None:
        """Say once per process (on global rank 0) that a phase starts, as DeepSpeed's optimizers do."""
        if phase in self._announced:
            return
        self._announced.add(phase)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"[megazero] {type(self).__name__}: from optimizer step {self._steps_taken() + 1} (skipped steps "
                  f"not counted), {phase}", flush=True)

    def bind_data_parallel(self, group) -> None:
        """The data-parallel group to average over (before the first compressed step)."""
        self._dp_group = group

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _flat_views(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> its view of the flat buffer (built on first use)."""
        params = self._params()
        if self._flat is None:
            world = dist.get_world_size(self._dp_group) if dist.is_initialized() else 1
            layout = BlockLayout([p.numel() for p in params], world)
            self._flat = torch.zeros(layout.numel, dtype=torch.float32, device=params[0].device)
            self._averager = CompressedAllReduce(layout, self._dp_group, params[0].device)
            self._views = layout.views(self._flat, [p.shape for p in params])
            if self._pending_rank_state is not None:
                self._averager.load_state_dict(self._pending_rank_state)
                self._pending_rank_state = None
        return dict(zip(map(id, params), self._views))

    def _variance_changed(self) -> None:
        """The variance moved (a plain step, a load): denominators and excluded positions are recomputed."""
        self._denominators.clear()
        self._zero_variance_stale = True

    def _denominator(self, p: torch.Tensor, eps: float) -> torch.Tensor:
        """sqrt(v) + eps of a parameter whose variance stays, computed once."""
        if p not in self._denominators:
            self._denominators[p] = self.state[p]["exp_avg_sq"].sqrt().add_(eps)
        return self._denominators[p]

    def _exclude_zero_variance(self) -> None:
        """Leave the positions whose variance is zero out of the compression (found again after the
        variance moved)."""
        if self._zero_variance_stale:
            params = self._params()
            offsets = self._averager.layout.offsets
            found = [(self.state[p]["exp_avg_sq"].flatten() == 0).nonzero().flatten() + offset
                     for p, offset in zip(params, offsets) if "exp_avg_sq" in self.state.get(p, {})]
            self._averager.exclude(torch.cat(found) if found else None)
            self._zero_variance_stale = False

    def _average(self) -> None:
        """The compressed average of the flat buffer over the group, in place; positions whose
        variance is zero are left out (they come back zero)."""
        self._exclude_zero_variance()
        self._averager.average(self._flat)

    def _average_preconditioned(self, values: dict[int, torch.Tensor], groups_params, bound) -> dict[int, torch.Tensor]:
        """Average each parameter's `values` (id -> tensor) over the group, compressed in the
        preconditioned space: value / denominator into the flat buffer, clamped to +-bound(betas),
        averaged, and back times the denominator. Returns id -> the flat buffer's view, holding the
        preconditioned average."""
        views = self._flat_views()
        for group, params in groups_params:
            targets = [views[id(p)] for p in params]
            torch._foreach_copy_(targets, [values[id(p)] for p in params])
            torch._foreach_div_(targets, [self._denominator(p, group["eps"]) for p in params])
            _clamp(targets, bound(group["betas"]))
        self._average()
        for group, params in groups_params:
            averaged = torch._foreach_mul([views[id(p)] for p in params],
                                          [self._denominator(p, group["eps"]) for p in params])
            torch._foreach_copy_([values[id(p)] for p in params], averaged)
        return views

    def rank_state_dict(self) -> dict:
        """This rank's compression errors."""
        return {"compression": self._averager.state_dict() if self._averager is not None else None}

    def load_rank_state_dict(self, state: dict | None) -> None:
        """Restore this rank's compression errors (None: zero)."""
        saved = None if state is None else state["compression"]
        if self._averager is None:
            self._pending_rank_state = saved
        else:
            self._averager.load_state_dict(saved)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's; the frozen variance's denominators are recomputed from what was loaded."""
        super().load_state_dict(state_dict)
        self._variance_changed()

    def _steps_taken(self) -> int:
        for p in self._params():
            if "step" in self.state.get(p, {}):
                return int(self.state[p]["step"].item())
        return 0


def _advance(optimizer: torch.optim.Optimizer) -> list[tuple[dict, list[torch.Tensor], list | None]]:
    """Per param group: (the group, its parameters with gradients, their 16-bit copies or None),
    their states made and their step counts advanced."""
    out = []
    for group in optimizer.param_groups:
        params, copies = optimizer._gather(group)
        for p in params:
            optimizer.state[p]["step"] += 1
        out.append((group, params, copies))
    return out


def momentum_bound(betas) -> float:
    """The largest |m| / sqrt(v) Adam itself can reach (Kingma and Ba): (1 - beta1) / sqrt(1 - beta2)
    / (1 - beta1 / sqrt(beta2)); inf when beta1 >= sqrt(beta2). With the variance frozen a
    coordinate whose gradient was rare (a rare token's embedding row) can exceed it by orders, and
    one such value sets its whole block's scale: the compressed stages clamp to it."""
    beta1, beta2 = betas
    if beta2 >= 1 or beta1 >= math.sqrt(beta2):
        return math.inf
    return (1 - beta1) / math.sqrt(1 - beta2) / (1 - beta1 / math.sqrt(beta2))


def gradient_bound(betas) -> float:
    """|g| / sqrt(v) where v has just taken g in: at most 1 / sqrt(1 - beta2) (0/1 Adam's gradients)."""
    return math.inf if betas[1] >= 1 else 1 / math.sqrt(1 - betas[1])


def _clamp(tensors: list[torch.Tensor], bound: float) -> None:
    if bound != math.inf:
        torch._foreach_clamp_min_(tensors, -bound)
        torch._foreach_clamp_max_(tensors, bound)


def _local_grads(optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients divided by the engine's grad_scale (unscale and clip; 1: as they are)."""
    scale = optimizer._scale()
    return [p.grad / scale if scale != 1.0 else p.grad for p in params]


def _adam_update(optimizer: _Compressing, group: dict, params: list[torch.Tensor]) -> None:
    """Adam's update with the variance as it stands (megazero's Adam arithmetic, no bias correction):
    p *= 1 - lr * weight_decay; p -= lr * m / (sqrt(v) + eps)."""
    lr, wd = group["lr"], group["weight_decay"]
    if wd:
        torch._foreach_mul_(params, 1 - lr * wd)
    torch._foreach_addcdiv_(params, [optimizer.state[p]["exp_avg"] for p in params],
                            [optimizer._denominator(p, group["eps"]) for p in params], value=-lr)


class OneBitAdam(_Compressing, FusedCPUAdam):
    """1-bit Adam (module docstring). In the compressed stage the flat buffer holds the momentum
    preconditioned, m / (sqrt(v) + eps): each step is momentum, compression and update on it, and
    `exp_avg` is written from it only when a state dict is taken. The buffer is saved per rank
    (rank_state_dict), so a resume at the same layout continues bit for bit."""

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bias_correction: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", use_op: bool | None = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=True,
                         bias_correction=False, use_op=use_op)
        self.freeze_step = freeze_step
        self._init_compressing(bias_correction)
        self._momentum_in_flat = False  # True: the flat buffer holds the momentum; exp_avg is stale

    @property
    def local_gradients(self) -> bool:
        """True once the warm-up's freeze_step steps are done: the momentum is averaged instead."""
        return self._steps_taken() >= self.freeze_step

    @torch.no_grad()
    def step(self, closure=None):
        """Adam during the warm-up; then each rank's momentum, with its own gradient, averaged
        compressed, and Adam's update with the frozen variance."""
        if not self.local_gradients:
            self._variance_changed()
            return super().step(closure)
        loss = closure() if closure is not None else None
        self._announce("the variance is frozen and the momentum is averaged 1-bit compressed")
        advanced = _advance(self)
        views = self._flat_views()
        if not self._momentum_in_flat:
            for group, params, _ in advanced:
                targets = [views[id(p)] for p in params]
                torch._foreach_copy_(targets, [self.state[p]["exp_avg"] for p in params])
                torch._foreach_div_(targets, [self._denominator(p, group["eps"]) for p in params])
            self._momentum_in_flat = True
        self._compressed_step(advanced, views)
        for _, params, copies in advanced:
            self._write_copies(params, copies)
        return loss

    def _denominator(self, p: torch.Tensor, eps: float) -> torch.Tensor:
        """sqrt(v) + eps, inf where v is 0 (no gradient yet: no update, nothing carried)."""
        if p not in self._denominators:
            variance = self.state[p]["exp_avg_sq"]
            self._denominators[p] = variance.sqrt().add_(eps).masked_fill_(variance == 0, math.inf)
        return self._denominators[p]

    def _compressed_step(self, advanced, views: dict) -> None:
        """Momentum, compressed average and update on the preconditioned momentum u in the flat buffer."""
        scale = self._scale()
        for group, params, _ in advanced:  # u = beta1 u + (1 - beta1) g / (sqrt(v) + eps), g unscaled here
            momenta = [views[id(p)] for p in params]
            torch._foreach_mul_(momenta, group["betas"][0])
            torch._foreach_addcdiv_(momenta, [p.grad for p in params],
                                    [self._denominator(p, group["eps"]) for p in params],
                                    value=(1 - group["betas"][0]) / scale)
            _clamp(momenta, momentum_bound(group["betas"]))
        self._average()
        for group, params, _ in advanced:  # p *= 1 - lr wd; p -= lr u (u = m / (sqrt(v) + eps))
            torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            torch._foreach_add_(params, [views[id(p)] for p in params], alpha=-group["lr"])

    def state_dict(self) -> dict:
        """torch's, with each exp_avg written from the flat buffer first (in the compressed stage)."""
        if self._momentum_in_flat:
            views = self._flat_views()
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        denominator = self._denominator(p, group["eps"])
                        momentum = torch.mul(views[id(p)], denominator, out=self.state[p]["exp_avg"])
                        momentum.masked_fill_(denominator.isinf(), 0.0)  # 0 x inf: no momentum there
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's; the flat buffer is rebuilt from exp_avg (or from this rank's file, rank_state_dict)."""
        super().load_state_dict(state_dict)
        self._momentum_in_flat = False

    def rank_state_dict(self) -> dict:
        """The compression errors, and in the compressed stage the momentum as the flat buffer holds it."""
        state = super().rank_state_dict()
        if self._momentum_in_flat:
            state["momentum"] = self._flat.clone()
        return state

    def load_rank_state_dict(self, state: dict | None) -> None:
        """Restore rank_state_dict()'s output (None: zero errors; the momentum from exp_avg)."""
        super().load_rank_state_dict(state)
        if state is not None and "momentum" in state:
            self._flat_views()
            self._flat.copy_(state["momentum"])
            self._momentum_in_flat = True


class OneBitLamb(_Compressing, FusedCPULamb):
    """1-bit LAMB (module docstring). Per-parameter state beyond LAMB's: `lamb_coeff_freeze` (the
    trust ratio's moving average), `last_factor` and `exp_avg_sq_fresh`. DeepSpeed also rescales the
    momenta to one common magnitude before compressing them, because one scale covers its whole
    buffer; with a scale per block (and the preconditioning) that rescaling changes nothing, so
    there is none here."""

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, bias_correction: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", use_op: bool | None = None):
        super().__init__(params, lr=lr, bias_correction=False, betas=betas, eps=eps, weight_decay=weight_decay,
                         max_coeff=max_coeff, min_coeff=min_coeff, use_op=use_op)
        self.freeze_step = freeze_step
        self.coeff_beta, self.factor_max, self.factor_min = coeff_beta, factor_max, factor_min
        self.factor_threshold = factor_threshold
        self._init_compressing(bias_correction)
        self._previous: dict[int, torch.Tensor] = {}  # each momentum before the step's gradient

    @property
    def local_gradients(self) -> bool:
        """True once the warm-up's freeze_step steps are done."""
        return self._steps_taken() >= self.freeze_step

    def _track_trust_ratios(self) -> None:
        """Warm-up: each tensor's trust ratio as this LAMB step will compute it, into its moving average."""
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            params, _ = self._gather(group)
            for p, g in zip(params, _local_grads(self, params)):
                state = self.state[p]
                state.setdefault("lamb_coeff_freeze", 0.0)
                state.setdefault("last_factor", 1.0)
                m = state["exp_avg"].mul(beta1).add_(g, alpha=1 - beta1)
                v = state["exp_avg_sq"].mul(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / (v.sqrt() + group["eps"])).add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm().item(), update.norm().item()
                if w_norm > 0 and u_norm > 0:
                    coeff = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
                    if coeff != 1.0:
                        state["lamb_coeff_freeze"] = (self.coeff_beta * state["lamb_coeff_freeze"]
                                                      + (1 - self.coeff_beta) * coeff)

    @torch.no_grad()
    def step(self, closure=None):
        """LAMB during the warm-up (tracking the trust ratios); then the compressed-momentum step."""
        if not self.local_gradients:
            self._variance_changed()
            self._track_trust_ratios()
            loss = super().step(closure)
            if self._steps_taken() == self.freeze_step:
                for p in self._params():
                    self.state[p]["exp_avg_sq_fresh"] = self.state[p]["exp_avg_sq"].clone()
            return loss
        loss = closure() if closure is not None else None
        self._announce("the variance and trust ratios are frozen and the momentum is averaged 1-bit compressed")
        advanced = _advance(self)
        momenta = {}
        for group, params, _ in advanced:
            beta1 = group["betas"][0]
            for p in params:
                if id(p) not in self._previous:
                    self._previous[id(p)] = torch.empty_like(p)
            current = [self.state[p]["exp_avg"] for p in params]
            torch._foreach_copy_([self._previous[id(p)] for p in params], current)
            torch._foreach_mul_(current, beta1)
            torch._foreach_add_(current, _local_grads(self, params), alpha=1 - beta1)
            momenta.update((id(p), self.state[p]["exp_avg"]) for p in params)
        self._average_preconditioned(momenta, [(group, params) for group, params, _ in advanced], momentum_bound)
        for group, params, copies in advanced:
            self._frozen_updates(group, params, [self._previous[id(p)] for p in params])
            self._write_copies(params, copies)
        return loss

    def _frozen_updates(self, group: dict, params: list[torch.Tensor], previous: list[torch.Tensor]) -> None:
        """The compressed-stage update of a group's parameters: the fresh variance from their averaged
        momenta, each tensor's frozen trust ratio times its clamped factor."""
        beta1, beta2, eps, decay = *group["betas"], group["eps"], group["weight_decay"]
        momenta = [self.state[p]["exp_avg"] for p in params]
        fresh = [self.state[p]["exp_avg_sq_fresh"] for p in params]
        denominators = [self._denominator(p, eps) for p in params]
        recovered = torch._foreach_add(momenta, previous, alpha=-beta1)  # the averaged gradient, recovered
        torch._foreach_div_(recovered, 1 - beta1)
        torch._foreach_mul_(fresh, beta2)
        torch._foreach_addcmul_(fresh, recovered, recovered, value=1 - beta2)
        del recovered
        fresh_denominators = torch._foreach_sqrt(fresh)
        torch._foreach_add_(fresh_denominators, eps)
        drift = torch.stack(torch._foreach_max(torch._foreach_div(denominators, fresh_denominators))).tolist()
        del fresh_denominators
        before_decay = torch._foreach_div(momenta, denominators)
        updates = torch._foreach_add(before_decay, params, alpha=decay)
        if decay > 0:
            norms = torch.stack([*torch._foreach_norm(before_decay), *torch._foreach_norm(updates)]).tolist()
        del before_decay
        scales = []
        for i, p in enumerate(params):
            state, factor = self.state[p], drift[i]
            if decay > 0:
                update_norm = norms[len(params) + i]
                ratio = min(1.0, norms[i] / update_norm) if update_norm > 0 else 1.0
                factor = factor * ratio + (1.0 - ratio)
            factor = min(max(factor, self.factor_min), self.factor_max)
            last = state["last_factor"]
            factor = min(max(factor, last * (1 - self.factor_threshold)), last * (1 + self.factor_threshold))
            state["last_factor"] = factor
            scales.append(-group["lr"] * state["lamb_coeff_freeze"] * factor)
        torch._foreach_mul_(updates, scales)
        torch._foreach_add_(params, updates)


_SCHEDULE = {"var_interval": 1, "var_counter": 0, "local_step_interval": 1, "local_step_counter": 0, "lrs": 0.0}


class ZeroOneAdam(_Compressing, FusedCPUAdam):
    """0/1 Adam (module docstring). Its schedule's counters (and each group's summed learning
    rates since the last synchronisation, `lrs`) are kept in the param groups, so checkpoints carry
    them; in the local-step phase the weights, momenta and momentum accumulators (the flat buffer)
    differ between ranks between synchronisations and are saved per rank (rank_state_dict)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 var_freeze_step: int = 100000, var_update_scaler: int = 16, local_step_scaler: int = 32678,
                 local_step_clipper: int = 16, bias_correction: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", use_op: bool | None = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=True,
                         bias_correction=False, use_op=use_op)
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        for group in self.param_groups:
            for key, value in _SCHEDULE.items():
                group.setdefault(key, value)
        self._init_compressing(bias_correction)

    @property
    def _local_phase(self) -> bool:
        return self._steps_taken() > self.var_freeze_step

    @property
    def local_gradients(self) -> bool:
        """False only for a step that updates the variance (its gradients are all-reduced in full)."""
        return self._local_phase or (self._steps_taken() + 1) % self.param_groups[0]["var_interval"] != 0

    def _set_schedule(self, **values) -> None:
        for group in self.param_groups:
            group.update(values)

    @torch.no_grad()
    def step(self, closure=None):
        """A variance step (Adam), a compressed-gradient step, or a local step (module docstring)."""
        schedule = self.param_groups[0]
        loss = closure() if closure is not None else None
        if self._local_phase:
            self._local_step()
            return loss
        if not self.local_gradients:
            self._variance_changed()
            super().step()
            counter = schedule["var_counter"] + 1
            if counter == self.var_update_scaler:
                self._set_schedule(var_counter=0, var_interval=2 * schedule["var_interval"])
            else:
                self._set_schedule(var_counter=counter)
        else:
            self._compressed_gradient_step()
        if self._local_phase:  # the variance is frozen from here: errors and accumulators start afresh
            self._flat_views()
            self._averager.load_state_dict(None)
            self._flat.zero_()
        return loss

    def _compressed_gradient_step(self) -> None:
        """Average a 1-bit compressed gradient; update the momentum with it, the variance stays."""
        self._announce("steps between variance updates average a 1-bit compressed gradient")
        advanced = _advance(self)
        gradients = {id(p): g.clone() for _, params, _ in advanced for p, g in zip(params, _local_grads(self, params))}
        self._average_preconditioned(gradients, [(group, params) for group, params, _ in advanced], gradient_bound)
        for group, params, copies in advanced:
            torch._foreach_lerp_([self.state[p]["exp_avg"] for p in params], [gradients[id(p)] for p in params],
                                 1 - group["betas"][0])
            _adam_update(self, group, params)
            self._write_copies(params, copies)

    def _local_step(self) -> None:
        """A step on this rank's own gradient; every local_step_interval steps, the synchronisation."""
        self._announce("the variance is frozen: local steps, their momentum synchronised 1-bit compressed")
        schedule = self.param_groups[0]
        advanced = _advance(self)
        views = self._flat_views()  # the momentum accumulators: the preconditioned moves since the last sync
        for group, params, _ in advanced:
            group["lrs"] += group["lr"]
            momenta = [self.state[p]["exp_avg"] for p in params]
            torch._foreach_lerp_(momenta, _local_grads(self, params), 1 - group["betas"][0])
            moves = torch._foreach_div(momenta, [self._denominator(p, group["eps"]) for p in params])
            _clamp(moves, momentum_bound(group["betas"]))
            torch._foreach_add_(moves, params, alpha=group["weight_decay"])
            torch._foreach_add_(params, moves, alpha=-group["lr"])
            torch._foreach_add_([views[id(p)] for p in params], moves, alpha=-group["lr"])
        if self._steps_taken() % schedule["local_step_interval"] == 0:
            self._synchronise(advanced, views)
        counter = schedule["local_step_counter"] + 1
        if counter == self.local_step_scaler:
            self._set_schedule(local_step_counter=0,
                               local_step_interval=min(self.local_step_clipper, 2 * schedule["local_step_interval"]))
        else:
            self._set_schedule(local_step_counter=counter)
        for _, params, copies in advanced:
            self._write_copies(params, copies)

    def _synchronise(self, advanced, views: dict) -> None:
        """The 1-bit sync: undo the local moves, average them (compressed), rebuild the momentum as
        their learning-rate-weighted average and apply them."""
        for _, params, _ in advanced:
            torch._foreach_sub_(params, [views[id(p)] for p in params])
        self._average()
        for group, params, _ in advanced:
            averaged = [views[id(p)] for p in params]
            if group["lrs"] > 0:  # all-zero learning rates moved nothing: the momentum stays
                momenta = [self.state[p]["exp_avg"] for p in params]
                torch._foreach_copy_(momenta, averaged)
                torch._foreach_mul_(momenta, [self._denominator(p, group["eps"]) for p in params])
                torch._foreach_div_(momenta, -group["lrs"])
            torch._foreach_add_(params, averaged)
            group["lrs"] = 0.0
        self._flat.zero_()

    def rank_state_dict(self) -> dict:
        """The compression errors; in the local-step phase also this rank's weights, momenta and
        momentum accumulators (they differ between ranks until the next synchronisation)."""
        state = super().rank_state_dict()
        if self._local_phase and self._flat is not None:
            params = self._params()
            state.update(params=[p.detach().clone() for p in params], accumulators=self._flat.clone(),
                         exp_avg=[self.state[p]["exp_avg"].clone() for p in params])
        return state

    def load_rank_state_dict(self, state: dict | None) -> None:
        """Restore rank_state_dict()'s output (None: zero errors and accumulators; the weights and
        momenta stay as loaded, data-parallel rank 0's)."""
        super().load_rank_state_dict(state)
        params = self._params()
        if state is not None and "params" in state:
            self._flat_views()
            self._flat.copy_(state["accumulators"])
            with torch.no_grad():
                for p, saved, m in zip(params, state["params"], state["exp_avg"]):
                    p.copy_(saved)
                    self.state[p]["exp_avg"].copy_(m)
        else:  # the accumulators start afresh, and so does the learning rate summed with them
            if self._flat is not None:
                self._flat.zero_()
            self._set_schedule(lrs=0.0)
