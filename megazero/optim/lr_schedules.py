"""Learning-rate schedules with DeepSpeed's names, parameters, defaults and formulas.

Each schedule sets the LR of every param group when it is built (iteration -1) and on every
`step()`, which the engine calls after each successful optimizer step. `last_batch_iteration`
counts completed steps; `state_dict()` holds only it, so restoring it restores the schedule.

Each schedule's `params_model` (declared next to it) is the schema of its `scheduler.params`: the
keys of its signature with their defaults and bounds, which the config validates against.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from pydantic import Field

from megazero.config_fields import Bool, Float, Int, NonNegativeFloats, Section

WARMUP_LOG = "log"
WARMUP_LINEAR = "linear"


def _set_lrs(optimizer: torch.optim.Optimizer, lrs: list[float]) -> list[float]:
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    return list(lrs)


def _per_group(optimizer: torch.optim.Optimizer, value, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name}: expected {len(optimizer.param_groups)} values (one per param group), "
                             f"got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _check_warmup_type(warmup_type: str) -> str:
    if warmup_type not in (WARMUP_LOG, WARMUP_LINEAR):
        raise ValueError(f"warmup_type must be '{WARMUP_LOG}' or '{WARMUP_LINEAR}', got {warmup_type!r}")
    return warmup_type


def _warmup_fraction(iteration: int, warmup_steps: int, warmup_type: str) -> float:
    """How far warm-up has come at `iteration` (0..1): log(i+1)/log(n) or i/n."""
    if warmup_type == WARMUP_LOG:
        return math.log(iteration + 1) / math.log(warmup_steps)
    return iteration / warmup_steps


class _Schedule:
    """Shared step/state logic: subclasses implement get_lr() for self.last_batch_iteration."""

    optimizer: torch.optim.Optimizer
    last_batch_iteration: int

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to the next iteration (or to `last_batch_iteration`) and set the LRs."""
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration is None
                                     else last_batch_iteration)
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def get_last_lr(self) -> list[float]:
        """The LRs set by the last step (or by construction)."""
        return self._last_lr

    def state_dict(self) -> dict:
        """{'last_batch_iteration': int}: all a schedule needs to resume."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        """Restore the iteration and re-apply its LRs to the optimizer."""
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())


WarmupType = Literal["log", "linear"]


class WarmupLRParams(Section):
    """WarmupLR: warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold."""

    warmup_min_lr: NonNegativeFloats = Field(0.0, description="LR at the start of warm-up (or one per param group)")
    warmup_max_lr: NonNegativeFloats = Field(0.001, description="LR at the end of warm-up (or one per param group)")
    warmup_num_steps: Int = Field(1000, ge=1, description="warm-up steps (at least 2 are taken)")
    warmup_type: WarmupType = Field(WARMUP_LOG, description="warm-up curve: log(i+1)/log(n) or linear i/n")


class WarmupLR(_Schedule):
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear), then hold."""

    params_model: ClassVar[type[Section]] = WarmupLRParams

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG,
                 last_batch_iteration: int = -1):
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
        self.optimizer = optimizer
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lrs(optimizer, self.get_lr())

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        """min + (max - min) * gamma(iteration); the minimum before the first step."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLRParams(WarmupLRParams):
    """WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""

    total_num_steps: Int = Field(ge=1, description="the step at which the LR reaches 0")


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    params_model: ClassVar[type[Section]] = WarmupDecayLRParams

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG,
                 last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLRParams(Section):
    """WarmupCosineLR: the optimizer's LR times a ratio warmed up to 1, then cosine-decayed."""

    total_num_steps: Int = Field(ge=1, description="the step at which the cosine reaches cos_min_ratio")
    warmup_min_ratio: Float = Field(0.0, ge=0, le=1, description="ratio at the start of warm-up")
    warmup_num_steps: Int = Field(1000, ge=1, description="warm-up steps (at least 2 are taken)")
    cos_min_ratio: Float = Field(0.0001, ge=0, le=1, description="ratio at the end of the cosine")
    warmup_type: WarmupType = Field(WARMUP_LOG, description="warm-up curve: log(i+1)/log(n) or linear i/n")


class WarmupCosineLR(_Schedule):
    """Warm up the ratio from warmup_min_ratio to 1, then cosine-decay it to cos_min_ratio.

    The LR is the optimizer's initial LR times the ratio.
    """

    params_model: ClassVar[type[Section]] = WarmupCosineLRParams

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = WARMUP_LOG,
                 last_batch_iteration: int = -1):
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _check_warmup_type(warmup_type)
        self.org_lrs = [group["lr"] for group in optimizer.param_groups]
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lrs(optimizer, self.get_lr())

    def get_lr_ratio(self) -> float:
        """The multiplier of the base LR at the current iteration."""
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            ratio = _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        progress = (self.last_batch_iteration - self.warmup_num_steps + 1) / max(
            1, self.total_num_steps - self.warmup_num_steps)
        cosine = (1 + math.cos(math.pi * min(1.0, progress))) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        """Base LR times get_lr_ratio()."""
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


def momentum_key(optimizer: torch.optim.Optimizer) -> str | None:
    """The param-group key holding the optimizer's momentum: 'betas' (beta1; Adam, Lamb), 'momentum'
    (SGD), or None when it has neither (Adagrad)."""
    for key in ("betas", "momentum"):
        if key in optimizer.defaults:
            return key
    return None


class OneCycleParams(Section):
    """OneCycle: LR up cycle_min_lr -> cycle_max_lr and back (momentum the other way), then decay."""

    cycle_min_lr: Float = Field(ge=0, description="LR at the start and end of the cycle")
    cycle_max_lr: Float = Field(ge=0, description="LR at the peak of the cycle")
    decay_lr_rate: Float = Field(0.0, ge=0, description="after the cycle: LR / (1 + rate * steps / decay_step_size)")
    cycle_first_step_size: Int = Field(2000, ge=1, description="steps of the rising half")
    cycle_second_step_size: Int | None = Field(None, ge=1, description="steps of the falling half (null: as rising)")
    cycle_first_stair_count: Int = Field(0, ge=0, description="stairs in the rising half (0: smooth)")
    cycle_second_stair_count: Int | None = Field(None, ge=0, description="stairs in the falling half (null: as rising)")
    decay_step_size: Int = Field(0, ge=0, description="steps per decay interval after the cycle (0: no decay)")
    cycle_momentum: Bool = Field(True, description="cycle beta1 (or SGD's momentum) inversely to the LR")
    cycle_min_mom: Float = Field(0.8, ge=0, description="momentum at the LR's peak")
    cycle_max_mom: Float = Field(0.9, ge=0, description="momentum at the start and end of the cycle")
    decay_mom_rate: Float = Field(0.0, ge=0,
                                  description="after the cycle: momentum * (1 + rate * steps / decay_step_size)")


class OneCycle(_Schedule):
    """1Cycle: LR rises cycle_min_lr -> cycle_max_lr and falls back (momentum moves the other way),
    optionally in stairs, then decays by 1/(1 + decay_lr_rate * steps/decay_step_size).

    The momentum cycled is beta1 for optimizers with `betas` and `momentum` for SGD; an optimizer
    with neither needs cycle_momentum=False (DeepSpeed would silently stop cycling).
    """

    params_model: ClassVar[type[Section]] = OneCycleParams

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: float, cycle_max_lr: float,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (float(cycle_second_step_size) if cycle_second_step_size is not None
                                 else self.first_step_size)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_lrs = [cycle_min_lr] * len(optimizer.param_groups)
        self.max_lrs = [cycle_max_lr] * len(optimizer.param_groups)
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = decay_step_size == 0 or decay_lr_rate == 0
        self.momentum_key = momentum_key(optimizer)
        if cycle_momentum and self.momentum_key is None:
            raise ValueError(f"OneCycle: cycle_momentum is true but the optimizer {type(optimizer).__name__} has "
                             f"neither 'betas' nor 'momentum' to cycle; set scheduler.params.cycle_momentum to false")
        self.cycle_momentum = cycle_momentum
        self.min_mom, self.max_mom, self.decay_mom_rate = cycle_min_mom, cycle_max_mom, decay_mom_rate
        self.skip_mom_decay = decay_step_size == 0 or decay_mom_rate == 0
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _set_lrs(optimizer, self.min_lrs)
            if self.cycle_momentum:
                self._set_momentum(self.min_mom)
        else:
            self._last_lr = _set_lrs(optimizer, self.get_lr())

    def _set_momentum(self, momentum: float) -> None:
        """beta1 (keeping beta2) or SGD's momentum, in every param group."""
        for group in self.optimizer.param_groups:
            if self.momentum_key == "betas":
                group["betas"] = (momentum, group["betas"][1])
            else:
                group["momentum"] = momentum

    def _scale_factor(self) -> float:
        iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + iteration / self.total_size)
        x = 1.0 + iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # quantise from the integer offset so a boundary never drops a whole stair
            in_cycle = iteration % self.total_size
            if in_cycle <= self.first_step_size:
                position = in_cycle * stairs / self.first_step_size
            else:
                position = (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list[float]:
        """Cycle LR inside the cycle, decayed cycle_min_lr after it."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        decay_steps = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_lr_rate * decay_steps / self.decay_step_size
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> float:
        """The momentum (beta1 or SGD's) at the current iteration: inverse to the LR in the cycle,
        decayed after it."""
        if self.last_batch_iteration < self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale_factor()
        if self.skip_mom_decay:
            return self.max_mom
        decay_steps = self.last_batch_iteration - self.total_size + 1
        return self.max_mom * (1 + self.decay_mom_rate * decay_steps / self.decay_step_size)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one batch: set the LR and, when cycling momentum, the momentum."""
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            self._set_momentum(self.get_mom())

    def load_state_dict(self, state: dict) -> None:
        """Restore the iteration and re-apply its LR and momentum."""
        super().load_state_dict(state)
        if self.cycle_momentum and self.last_batch_iteration >= 0:
            self._set_momentum(self.get_mom())


class LRRangeTestParams(Section):
    """LRRangeTest: LR grows from lr_range_test_min_lr by step_rate per step_size steps."""

    lr_range_test_min_lr: NonNegativeFloats = Field(1e-3, description="starting LR (or one per param group)")
    lr_range_test_step_size: Int = Field(2000, ge=1, description="steps per interval")
    lr_range_test_step_rate: Float = Field(1.0, ge=0, description="LR increase per interval, as a multiple of min_lr")
    lr_range_test_staircase: Bool = Field(False, description="grow in whole intervals (stairs) instead of smoothly")


class LRRangeTest(_Schedule):
    """LR range test: lr = min_lr * (1 + step_rate * interval), interval = (i + 1) / step_size
    (floored when staircase)."""

    params_model: ClassVar[type[Section]] = LRRangeTestParams

    def __init__(self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: float = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lrs(optimizer, self.min_lrs if last_batch_iteration == -1 else self.get_lr())

    def get_lr(self) -> list[float]:
        """min_lr times the increase at the current iteration."""
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lrs]


class MegatronLRParams(Section):
    """MegatronLR: Megatron-LM's schedule, in consumed samples (the recipes' --lr-* flags write it)."""

    decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = Field(
        "linear", description="the decay after warm-up")
    min_lr: Float = Field(0.0, ge=0, description="the LR the decay ends at, and holds after it")
    warmup_init_lr: Float = Field(0.0, ge=0, description="the LR warm-up starts from")
    warmup_num_samples: Int = Field(0, ge=0, description="samples of the linear warm-up to the optimizer's LR")
    decay_num_samples: Int = Field(ge=1, description="samples after which the LR is min_lr")
    samples_per_step: Int = Field(ge=1, description="samples each optimizer step consumes (the global batch; the "
                                                    "engine's set_train_batch_size changes it)")


class MegatronLR(_Schedule):
    """Megatron-LM's learning rate: linear warm-up from warmup_init_lr to the optimizer's LR over
    warmup_num_samples, then constant, linear, cosine or inverse-square-root decay to min_lr at
    decay_num_samples, then min_lr. Counted in samples, as Megatron counts them: `step()` adds
    samples_per_step, so a batch ramp-up (which changes it) slows the schedule as it does there."""

    params_model: ClassVar[type[Section]] = MegatronLRParams

    def __init__(self, optimizer: torch.optim.Optimizer, decay_num_samples: int, samples_per_step: int,
                 decay_style: str = "linear", min_lr: float = 0.0, warmup_init_lr: float = 0.0,
                 warmup_num_samples: int = 0, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        self.decay_style, self.min_lr, self.warmup_init_lr = decay_style, min_lr, warmup_init_lr
        self.warmup_num_samples, self.decay_num_samples = warmup_num_samples, decay_num_samples
        self.samples_per_step = samples_per_step
        self.consumed_samples = (last_batch_iteration + 1) * samples_per_step
        self.max_lrs = [group["lr"] for group in optimizer.param_groups]
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lrs(optimizer, self.get_lr())

    def _lr(self, max_lr: float) -> float:
        n, warmup, decay = self.consumed_samples, self.warmup_num_samples, self.decay_num_samples
        if warmup > 0 and n <= warmup:
            return self.warmup_init_lr + (max_lr - self.warmup_init_lr) * n / warmup
        if self.decay_style == "constant":
            return max_lr
        if n > decay:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            return max(self.min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
        ratio = (n - warmup) / max(1, decay - warmup)
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (max_lr - self.min_lr)

    def get_lr(self) -> list[float]:
        """Each param group's LR at the samples consumed so far."""
        return [self._lr(max_lr) for max_lr in self.max_lrs]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """One optimizer step of samples_per_step samples (or, given `last_batch_iteration`, that many
        steps of samples_per_step from the start)."""
        if last_batch_iteration is None:
            self.consumed_samples += self.samples_per_step
        else:
            self.consumed_samples = (last_batch_iteration + 1) * self.samples_per_step
        super().step(last_batch_iteration)

    def state_dict(self) -> dict:
        """The iteration and the samples consumed (which differ from iterations x batch under a ramp-up)."""
        return {"last_batch_iteration": self.last_batch_iteration, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        """Restore the iteration and the samples consumed, and re-apply their LRs."""
        self.consumed_samples = int(state["consumed_samples"])
        super().load_state_dict(state)


SCHEDULERS: dict[str, type] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
    "MegatronLR": MegatronLR,
}


def build_scheduler(name: str, optimizer: torch.optim.Optimizer, params: dict) -> _Schedule:
    """Build the schedule `name` from its DeepSpeed params (already key-checked by the config)."""
    return SCHEDULERS[name](optimizer, **params)
