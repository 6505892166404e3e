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

As in DeepSpeed: the update adds `weight_decay` decoupled (AdamW's form), the moments are never
bias-corrected (`bias_correction` is accepted and has no effect, as there), ZeRO stages 1-3 are
refused. Unlike DeepSpeed: the first step updates the weights (DeepSpeed's only initialises), and
the compression errors are saved per rank and restored at the same layout (DeepSpeed resets them).
`comm_backend_name` and `cuda_aware` name DeepSpeed's NCCL/MPI backends; megazero communicates over
the engine's data-parallel group with what is fast on its backend, so they have no effect.
"""

from __future__ import annotations

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

    var_freeze_step: Int = Field(100000, ge=0, description="the last step that may update the variance; local "
                                                           "steps follow")
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
    parameter (what is compressed), its CompressedAllReduce and the per-rank state protocol."""

    def _init_compressing(self, bias_correction: bool) -> None:
        if bias_correction:
            warnings.warn(f"{type(self).__name__}: 'bias_correction' true has no effect: the moments are never "
                          f"bias-corrected (DeepSpeed's implementation ignores it too)", stacklevel=4)
        self._dp_group = None
        self._averager: CompressedAllReduce | None = None
        self._flat: torch.Tensor | None = None
        self._pending_rank_state: dict | None = None
        # sqrt(v) + eps per parameter while the variance is frozen (cleared whenever it changes)
        self._denominators: dict[torch.Tensor, torch.Tensor] = {}

    def bind_data_parallel(self, group) -> None:
        """The data-parallel group to average over (before the first compressed step)."""
        self._dp_group = group

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _flat_views(self) -> list[torch.Tensor]:
        """Each parameter's view of the flat buffer (built on first use)."""
        params = self._params()
        if self._flat is None:
            world = dist.get_world_size(self._dp_group) if dist.is_initialized() else 1
            layout = BlockLayout([p.numel() for p in params], world)
            self._flat = torch.zeros(layout.numel, dtype=torch.float32, device=params[0].device)
            self._averager = CompressedAllReduce(layout, self._dp_group, params[0].device)
            if self._pending_rank_state is not None:
                self._averager.load_state_dict(self._pending_rank_state)
                self._pending_rank_state = None
        return self._averager.layout.views(self._flat, [p.shape for p in params])

    def _average(self) -> None:
        """The compressed average of the flat buffer over the group, in place."""
        self._averager.average(self._flat)

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

    def _denominator(self, p: torch.Tensor, eps: float) -> torch.Tensor:
        """sqrt(v) + eps of a parameter whose variance is frozen, computed once."""
        if p not in self._denominators:
            self._denominators[p] = self.state[p]["exp_avg_sq"].sqrt().add_(eps)
        return self._denominators[p]

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's; the frozen variance is recomputed from what was loaded."""
        super().load_state_dict(state_dict)
        self._denominators.clear()

    def _steps_taken(self) -> int:
        for p in self._params():
            if "step" in self.state.get(p, {}):
                return int(self.state[p]["step"].item())
        return 0


class _FlatMomentum(_Compressing):
    """1-bit Adam's and LAMB's: every `exp_avg` is a view of the flat compressed buffer."""

    def _gather(self, group: dict):
        params, copies = super()._gather(group)
        self._bind_momentum()
        return params, copies

    def _bind_momentum(self) -> None:
        """Make every exp_avg a view of the flat buffer (after the states are made or loaded)."""
        params = self._params()
        if not all("exp_avg" in self.state.get(p, {}) for p in params):
            return
        views = self._flat_views()
        for p, view in zip(params, views):
            state = self.state[p]
            if state["exp_avg"] is not view:
                view.copy_(state["exp_avg"])
                state["exp_avg"] = view

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, then the momenta back into the flat buffer."""
        super().load_state_dict(state_dict)
        self._bind_momentum()


def _advance(optimizer: torch.optim.Optimizer, group: dict) -> tuple[list[torch.Tensor], list | None]:
    """(the group's parameters with gradients, their 16-bit copies or None), their states made and
    their step counts advanced."""
    params, copies = optimizer._gather(group)
    for p in params:
        optimizer.state[p]["step"] += 1
    return params, copies


def _local_grads(optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients divided by the engine's grad_scale (unscale and clip; 1: as they are)."""
    scale = optimizer._scale()
    return [p.grad / scale if scale != 1.0 else p.grad for p in params]


def _adam_update(optimizer: _Compressing, group: dict, params: list[torch.Tensor]) -> None:
    """Adam's update with the frozen variance (megazero's Adam arithmetic, no bias correction):
    p *= 1 - lr * weight_decay; p -= lr * m / (sqrt(v) + eps)."""
    lr, wd = group["lr"], group["weight_decay"]
    if wd:
        torch._foreach_mul_(params, 1 - lr * wd)
    torch._foreach_addcdiv_(params, [optimizer.state[p]["exp_avg"] for p in params],
                            [optimizer._denominator(p, group["eps"]) for p in params], value=-lr)


class OneBitAdam(_FlatMomentum, FusedCPUAdam):
    """1-bit Adam (module docstring); `exp_avg` is a view of the flat compressed buffer."""

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bias_correction: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", use_op: bool | None = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=True,
                         bias_correction=False, use_op=use_op)
        self.freeze_step = freeze_step
        self._init_compressing(bias_correction)

    @property
    def local_gradients(self) -> bool:
        """True once the warm-up's freeze_step steps are done: the momentum is averaged instead."""
        return self._steps_taken() >= self.freeze_step

    @torch.no_grad()
    def step(self, closure=None):
        """Adam during the warm-up; then the compressed-momentum step."""
        if not self.local_gradients:
            self._denominators.clear()
            return super().step(closure)
        loss = closure() if closure is not None else None
        updated = []
        for group in self.param_groups:
            params, copies = _advance(self, group)
            torch._foreach_lerp_([self.state[p]["exp_avg"] for p in params], _local_grads(self, params),
                                 1 - group["betas"][0])
            updated.append((group, params, copies))
        self._average()
        for group, params, copies in updated:
            _adam_update(self, group, params)
            self._write_copies(params, copies)
        return loss


class OneBitLamb(_FlatMomentum, FusedCPULamb):
    """1-bit LAMB (module docstring). Per-parameter state beyond LAMB's: `lamb_coeff_freeze` (the
    trust ratio's moving average), `last_factor` and `exp_avg_sq_fresh`. DeepSpeed also rescales the
    momenta to one common magnitude before compressing them, because one scale covers its whole
    buffer; with a scale per block that rescaling changes nothing, so there is none here."""

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
            self._denominators.clear()
            self._track_trust_ratios()
            loss = super().step(closure)
            if self._steps_taken() == self.freeze_step:
                for p in self._params():
                    self.state[p]["exp_avg_sq_fresh"] = self.state[p]["exp_avg_sq"].clone()
            return loss
        loss = closure() if closure is not None else None
        params_of = [_advance(self, group) for group in self.param_groups]
        previous = {}
        for group, (params, _) in zip(self.param_groups, params_of):
            beta1 = group["betas"][0]
            for p, g in zip(params, _local_grads(self, params)):
                state = self.state[p]
                previous[p] = state["exp_avg"].clone()
                state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
        self._average()
        for group, (params, copies) in zip(self.param_groups, params_of):
            beta1, beta2 = group["betas"]
            for p in params:
                self._lamb_frozen_update(group, p, previous.pop(p), beta1, beta2)
            self._write_copies(params, copies)
        return loss

    def _lamb_frozen_update(self, group: dict, p: torch.Tensor, previous: torch.Tensor, beta1: float,
                            beta2: float) -> None:
        """One parameter's compressed-stage update: the fresh variance from its averaged momentum,
        the frozen trust ratio times the clamped factor."""
        state = self.state[p]
        m = state["exp_avg"]
        fresh = state["exp_avg_sq_fresh"]
        recovered = (m - beta1 * previous) / (1 - beta1)
        fresh.mul_(beta2).addcmul_(recovered, recovered, value=1 - beta2)
        denom = self._denominator(p, group["eps"])
        before_decay = m / denom
        update = before_decay.add(p, alpha=group["weight_decay"])
        factor = (denom / fresh.sqrt().add_(group["eps"])).max().item()
        if group["weight_decay"] > 0:
            update_norm = update.norm().item()
            ratio = min(1.0, before_decay.norm().item() / update_norm) if update_norm > 0 else 1.0
            factor = factor * ratio + (1.0 - ratio)
        factor = min(max(factor, self.factor_min), self.factor_max)
        last = state["last_factor"]
        factor = min(max(factor, last * (1 - self.factor_threshold)), last * (1 + self.factor_threshold))
        state["last_factor"] = factor
        p.add_(update, alpha=-group["lr"] * state["lamb_coeff_freeze"] * factor)


_SCHEDULE = {"var_interval": 1, "var_counter": 0, "local_step_interval": 1, "local_step_counter": 0, "lrs": 0.0}


class ZeroOneAdam(_Compressing, FusedCPUAdam):
    """0/1 Adam (module docstring). Its schedule's counters (and each group's summed learning
    rates since the last synchronisation, `lrs`) are kept in the param groups, so checkpoints carry
    them; in the local-step phase the weights, momenta and momentum accumulators differ between
    ranks between synchronisations and are saved per rank (rank_state_dict)."""

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
        if self._local_phase:
            loss = closure() if closure is not None else None
            self._local_step()
            return loss
        if not self.local_gradients:
            self._denominators.clear()
            loss = super().step(closure)
            counter = schedule["var_counter"] + 1
            if counter == self.var_update_scaler:
                self._set_schedule(var_counter=0, var_interval=2 * schedule["var_interval"])
            else:
                self._set_schedule(var_counter=counter)
        else:
            loss = closure() if closure is not None else None
            self._compressed_gradient_step()
        if self._local_phase:  # the variance is frozen from here: errors and accumulators start afresh
            self._flat_views()
            self._averager.load_state_dict(None)
            self._flat.zero_()
        return loss

    def _compressed_gradient_step(self) -> None:
        """Average a 1-bit compressed gradient; update the momentum with it, the variance stays."""
        params_of = [_advance(self, group) for group in self.param_groups]
        views = dict(zip(map(id, self._params()), self._flat_views()))
        for params, _ in params_of:
            for p, g in zip(params, _local_grads(self, params)):
                views[id(p)].copy_(g)
        self._average()
        for group, (params, copies) in zip(self.param_groups, params_of):
            torch._foreach_lerp_([self.state[p]["exp_avg"] for p in params], [views[id(p)] for p in params],
                                 1 - group["betas"][0])
            _adam_update(self, group, params)
            self._write_copies(params, copies)

    def _local_step(self) -> None:
        """A step on this rank's own gradient; every local_step_interval steps, the synchronisation."""
        schedule = self.param_groups[0]
        params_of = [_advance(self, group) for group in self.param_groups]
        views = dict(zip(map(id, self._params()), self._flat_views()))  # the momentum accumulators
        for group, (params, _) in zip(self.param_groups, params_of):
            group["lrs"] += group["lr"]
            for p, g in zip(params, _local_grads(self, params)):
                state = self.state[p]
                state["exp_avg"].lerp_(g, 1 - group["betas"][0])
                move = (state["exp_avg"] / self._denominator(p, group["eps"])).add_(p, alpha=group["weight_decay"])
                p.sub_(move, alpha=group["lr"])
                views[id(p)].sub_(move, alpha=group["lr"])
        if self._steps_taken() % schedule["local_step_interval"] == 0:
            self._synchronise(params_of, views)
        counter = schedule["local_step_counter"] + 1
        if counter == self.local_step_scaler:
            self._set_schedule(local_step_counter=0,
                               local_step_interval=min(self.local_step_clipper, 2 * schedule["local_step_interval"]))
        else:
            self._set_schedule(local_step_counter=counter)
        for params, copies in params_of:
            self._write_copies(params, copies)

    def _synchronise(self, params_of, views: dict) -> None:
        """The 1-bit sync: undo the local moves, average their learning-rate-weighted momentum
        (compressed), rebuild the momentum from it and apply it."""
        denoms = {}
        for group, (params, _) in zip(self.param_groups, params_of):
            for p in params:
                denoms[id(p)] = self._denominator(p, group["eps"])
                p.sub_(views[id(p)])
                views[id(p)].mul_(denoms[id(p)])
        self._average()
        for group, (params, _) in zip(self.param_groups, params_of):
            for p in params:
                if group["lrs"] > 0:  # all-zero learning rates moved nothing: the momentum stays
                    self.state[p]["exp_avg"].copy_(views[id(p)]).div_(-group["lrs"])
                p.addcdiv_(views[id(p)], denoms[id(p)])
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
