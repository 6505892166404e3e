"""Pipeline schedules as data (megazero.pipeline.actions): the generated 1F1B and ZB-H1 schedules are
valid (every action once, each after what it needs, within 1F1B's activations), the checker catches a W
before its B, a schedule over its memory bound, a deadlock and a missing action, and the simulated
bubbles are the formulas' (1F1B: (p - 1)(F + B + W); ZB-H1 at p = 2: (p - 1)(F + B - W))."""

from __future__ import annotations

import dataclasses

import pytest

from megazero.pipeline.actions import (
    SCHEDULES,
    Action,
    B,
    F,
    InvalidSchedule,
    W,
    check_schedule,
    one_f_one_b,
    simulate,
    zero_bubble_h1,
)
from megazero.pipeline.schedule import _weights_after


def _bounds(p: int) -> list[int]:
    return [p - r for r in range(p)]  # 1F1B's: rank r holds at most p - r micro-batches' activations


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 12])
def test_generated_schedules_are_valid_within_1f1b_memory(name, p, m):
    schedule = SCHEDULES[name](p, m)
    check_schedule(schedule, max_in_flight=_bounds(p), max_deferred=[b + 1 for b in _bounds(p)])
    if name == "zb-h1":  # every B split: its W on the same rank, after it
        for r, actions in enumerate(schedule.ranks):
            assert sorted(a.micro for a in actions if a.kind == W) == list(range(m)), r


def _replace(schedule, rank: int, actions: list[Action]):
    ranks = [list(r) for r in schedule.ranks]
    ranks[rank] = actions
    return dataclasses.replace(schedule, ranks=ranks)


def test_a_w_before_its_b_is_caught():
    schedule = zero_bubble_h1(2, 4)
    actions = list(schedule.ranks[0])
    w = actions.index(Action(W, 0, 0))
    actions.insert(0, actions.pop(w))
    with pytest.raises(InvalidSchedule, match=r"rank 0 position 0: W0 runs before its B"):
        check_schedule(_replace(schedule, 0, actions))


def test_memory_bound_deadlock_and_missing_actions_are_caught():
    p, m = 2, 4
    gpipe = [Action(F, 0, i) for i in range(m)] + [Action(B, 0, i) for i in range(m)]  # all forwards first
    schedule = one_f_one_b(p, m)
    check_schedule(_replace(schedule, 0, gpipe))  # valid without a bound
    with pytest.raises(InvalidSchedule, match=r"rank 0 position 2: after F2 it holds 3 micro-batches' activations, "
                                              r"over the bound 2"):
        check_schedule(_replace(schedule, 0, gpipe), max_in_flight=_bounds(p))
    deferring = zero_bubble_h1(p, m)
    late = [a for a in deferring.ranks[0] if a.kind != W] + [Action(W, 0, i) for i in range(m)]
    with pytest.raises(InvalidSchedule, match=r"rank 0 position \d+: after B2 it holds 3 weight gradients pending, "
                                              r"over the bound 2"):
        check_schedule(_replace(deferring, 0, late), max_deferred=[2, 2])
    backwards_first = [Action(B, 0, 0)] + [a for a in schedule.ranks[1] if a != Action(B, 0, 0)]
    with pytest.raises(InvalidSchedule, match=r"deadlocks.*\{0: 'B0', 1: 'B0'\}"):
        check_schedule(_replace(schedule, 1, backwards_first))
    with pytest.raises(InvalidSchedule, match=r"rank 1: B3 is missing"):
        check_schedule(_replace(schedule, 1, schedule.ranks[1][:-1]))


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16)])
@pytest.mark.parametrize("f, b, w", [(1.0, 1.0, 1.0), (1.0, 1.2, 0.8)])
def test_simulated_bubbles_are_the_formulas(p, m, f, b, w):
    """1F1B's bubble is (p - 1)(F + B + W) (B + W: its whole backward); ZB-H1's is the paper's
    (p - 1)(F + B - W) at p = 2 with equal costs, and between the two otherwise."""
    step = m * (f + b + w)
    assert simulate(one_f_one_b(p, m), f, b, w).makespan == pytest.approx(step + (p - 1) * (f + b + w))
    zb = simulate(zero_bubble_h1(p, m, f, b, w), f, b, w).makespan
    if p == 2 and f == b == w:
        assert zb == pytest.approx(step + (p - 1) * (f + b - w))
    assert step + (p - 1) * (f + b - w) - 1e-9 <= zb < step + (p - 1) * (f + b + w)


def test_the_split_runner_takes_1f1b_order_only():
    schedule = zero_bubble_h1(2, 4)
    last = [Action(kind, 0, i) for i in range(4) for kind in (F, B, W)]  # F B W, one micro-batch at a time
    assert _weights_after(_replace(schedule, 1, last), 1) == {1: [0], 3: [1], 5: [2], 7: [3]}
    swapped = list(schedule.ranks[0])
    swapped[0], swapped[1] = swapped[1], swapped[0]
    with pytest.raises(ValueError, match="rank 0's forwards and backwards are not in 1F1B's order"):
        _weights_after(_replace(schedule, 0, swapped), 0)
