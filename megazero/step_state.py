"""The engine's step bookkeeping, in one object: where the engine stands in its accumulation window
and what its optimizer steps did.

The engine (megazero.engine) advances it; checkpoints save and restore it whole (`state_dict` /
`load_state_dict`); the watchdog and the numerics report read it. Nobody else writes it.

An accumulation window is `gradient_accumulation_steps` micro-steps (one `engine.step()` call
each); the last one is the boundary, where the optimizer steps. A batch ramp-up changes the
accumulation steps between optimizer steps, so the position in the window is counted from
`accumulation_origin`, the micro-step at which they last changed.
"""

from __future__ import annotations

from dataclasses import dataclass

# what a checkpoint saves, under these names (the top level of the model state file, as DeepSpeed's)
SAVED = ("global_steps", "global_samples", "micro_steps", "skipped_steps", "nan_steps")


@dataclass
class StepState:
    """Counters and flags of the engine's step (see the module docstring)."""

    micro_steps: int = 0  # step() calls so far
    global_steps: int = 0  # optimizer steps so far (boundaries, skipped ones included)
    global_samples: int = 0  # samples over all data-parallel ranks consumed by those steps
    skipped_steps: int = 0  # optimizer steps skipped for an inf/nan gradient (any cause)
    # skipped steps whose gradients were inf/nan with no dynamic loss scale to blame (fp32, bf16,
    # static fp16): a diverging run, not a loss-scale search
    nan_steps: int = 0
    # skipped steps in a row, toward max_consecutive_skipped_steps (not saved: a resumed run counts afresh)
    consecutive_skipped: int = 0
    accumulation_origin: int = 0  # micro_steps when the accumulation steps last changed
    # training forwards since the last optimizer step: the micro-batch's number within its step
    forwards_since_step: int = 0
    pipeline_micro: int | None = None  # the 1F1B schedule's micro-batch in forward, if any
    boundary_override: bool | None = None  # set_gradient_accumulation_boundary()
    inside_no_sync: bool = False
    step_applied: bool = False  # the latest step() updated the weights
    reduced_at_micro_step: int | None = None  # a backward that started reductions, not yet stepped
    last_grad_norm: float | None = None  # unscaled, before clipping; inf/nan for a skipped step
    last_step_overflowed: bool = False

    # ---- reading -------------------------------------------------------------------------------
    def into_step(self, accumulation_steps: int) -> int:
        """Micro-steps taken into the current optimizer step (0 at its first)."""
        return (self.micro_steps - self.accumulation_origin) % accumulation_steps

    def is_boundary(self, accumulation_steps: int) -> bool:
        """True when the current micro-step ends the accumulation window (unless overridden)."""
        if self.boundary_override is not None:
            return self.boundary_override
        return self.into_step(accumulation_steps) + 1 == accumulation_steps

    def micro_batches_started(self) -> int:
        """Micro-batches of the current step whose forward has started (0 between steps)."""
        return self.pipeline_micro + 1 if self.pipeline_micro is not None else self.forwards_since_step

    # ---- advancing -----------------------------------------------------------------------------
    def next_forward(self) -> int:
        """The number, within its step, of the training forward starting now: the pipeline
        schedule's micro-batch, else the forwards since the last step (counted)."""
        if self.pipeline_micro is not None:
            return self.pipeline_micro
        self.forwards_since_step += 1
        return self.forwards_since_step - 1

    def record_optimizer_step(self, grad_norm: float, overflowed: bool, nan: bool) -> None:
        """The optimizer step just decided: its norm, and whether it was skipped (`nan`: with no
        dynamic loss scale to blame)."""
        self.last_grad_norm = grad_norm
        self.last_step_overflowed = overflowed
        if overflowed:
            self.skipped_steps += 1
            self.nan_steps += nan
            self.consecutive_skipped += 1
        else:
            self.consecutive_skipped = 0

    def end_micro_step(self, boundary: bool, samples: int) -> None:
        """step() done; at the `boundary` one more optimizer step of `samples` samples."""
        if boundary:
            self.step_applied = not self.last_step_overflowed
            self.forwards_since_step = 0
            self.global_steps += 1
            self.global_samples += samples
        self.micro_steps += 1

    def restart_window(self) -> None:
        """The accumulation steps change from the next micro-step on (between optimizer steps)."""
        self.accumulation_origin = self.micro_steps

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self, accumulation_steps: int) -> dict:
        """What a checkpoint saves: the counters, and the micro-steps taken into the current step
        (with a batch ramp-up micro_steps alone does not say it)."""
        return {**{name: getattr(self, name) for name in SAVED},
                "micro_steps_into_step": self.into_step(accumulation_steps)}

    def load_state_dict(self, state: dict, accumulation_steps: int, same_layout: bool) -> None:
        """Restore state_dict()'s output. At another layout (which may accumulate another number
        of micro-batches per step) the run resumes at the start of its next step. A checkpoint
        without `nan_steps` restores it as 0."""
        for name in SAVED:
            setattr(self, name, int(state.get(name, 0)))
        into = state.get("micro_steps_into_step", self.micro_steps % accumulation_steps)
        if not same_layout:
            self.micro_steps, into = self.global_steps * accumulation_steps, 0
        self.accumulation_origin = self.micro_steps - into
        self.forwards_since_step = into
        self.consecutive_skipped = 0
        self.reduced_at_micro_step = None


class StepField:
    """An attribute of the engine that is a field of its StepState (`engine.steps`): DeepSpeed's
    public counters (engine.global_steps, ...) read and write it there."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, engine, owner=None):
        return self if engine is None else getattr(engine.steps, self.name)

    def __set__(self, engine, value) -> None:
        setattr(engine.steps, self.name, value)
