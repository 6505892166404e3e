"""The engine's step bookkeeping (megazero.step_state.StepState): the accumulation window, the
counters a checkpoint carries, and where a resumed run stands at the same or another layout."""

from __future__ import annotations

from megazero.step_state import StepState


def _run(state: StepState, micro_steps: int, accumulation: int, overflow_at: tuple[int, ...] = ()) -> None:
    """`micro_steps` step() calls as the engine makes them."""
    for _ in range(micro_steps):
        boundary = state.is_boundary(accumulation)
        if boundary:
            overflowed = state.global_steps in overflow_at
            state.record_optimizer_step(float("nan") if overflowed else 1.0, overflowed, nan=overflowed)
        state.next_forward()
        state.end_micro_step(boundary, samples=8)


def test_the_window_counts_micro_steps_from_the_last_change():
    state = StepState()
    _run(state, 5, accumulation=2)  # steps at micro-steps 2 and 4; one micro-step into the third
    assert (state.global_steps, state.global_samples, state.into_step(2), state.forwards_since_step) == (2, 16, 1, 1)
    assert state.is_boundary(2)
    _run(state, 1, accumulation=2)
    state.restart_window()  # a ramp-up: 3 micro-steps per step from here on
    _run(state, 2, accumulation=3)
    assert (state.global_steps, state.into_step(3), state.is_boundary(3)) == (3, 2, True)
    state.boundary_override = False
    assert not state.is_boundary(3)


def test_skipped_and_nan_steps_are_counted_and_saved():
    state = StepState()
    _run(state, 8, accumulation=2, overflow_at=(1, 2))
    assert (state.skipped_steps, state.nan_steps, state.consecutive_skipped) == (2, 2, 0)
    assert not state.last_step_overflowed and state.step_applied
    saved = state.state_dict(2)
    assert saved == {"global_steps": 4, "global_samples": 32, "micro_steps": 8, "skipped_steps": 2, "nan_steps": 2,
                     "micro_steps_into_step": 0}


def test_a_resume_stands_where_the_save_stood_or_at_the_next_step():
    state = StepState()
    _run(state, 7, accumulation=3)  # 2 steps, 1 micro-step into the third
    saved = state.state_dict(3)
    same = StepState()
    same.load_state_dict(saved, 3, same_layout=True)
    assert (same.micro_steps, same.into_step(3), same.forwards_since_step) == (7, 1, 1)
    other = StepState()
    other.load_state_dict(saved, 4, same_layout=False)  # another layout: 4 micro-steps per step
    assert (other.global_steps, other.micro_steps, other.into_step(4), other.forwards_since_step) == (2, 8, 0, 0)
    older = StepState()
    older.load_state_dict({k: v for k, v in saved.items() if k != "nan_steps"}, 3, same_layout=True)
    assert older.nan_steps == 0 and older.global_steps == 2
