"""Pipeline schedules as data (megazero.pipeline.actions): the generated 1F1B, ZB-H1 and ZBV schedules
are valid (every action once, each after what it needs, within 1F1B's activations: ZBV's 2p half-stage
chunks), the checker catches a W before its B, a schedule over its memory bound, a deadlock and a
missing action, and the simulated bubbles are the formulas' (1F1B: (p - 1)(F + B + W); ZB-H1 at p = 2:
(p - 1)(F + B - W)), ZBV's within 0.35x 1F1B's. The action runner's exchange rounds pair every send
with its receive in the same round."""

from __future__ import annotations

import dataclasses

import pytest

from megazero.pipeline.action_runner import exchange_rounds
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
    zero_bubble_v,
)
from megazero.pipeline.schedule import _weights_after


def _bounds(p: int) -> list[int]:
    return [p - r for r in range(p)]  # 1F1B's: rank r holds at most p - r micro-batches' activations


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 12])
def test_generated_schedules_are_valid_within_1f1b_memory(name, p, m):
    if name == "zbv" and m < 2 * p:
        with pytest.raises(ValueError, match=f"zbv needs at least 2 x {p} stages = {2 * p} micro-batches"):
            SCHEDULES[name](p, m)
        return
    schedule = SCHEDULES[name](p, m)
    if name == "zbv":  # 2 chunks of half a stage each: 2p in flight is 1F1B's p micro-batches on rank 0
        check_schedule(schedule, max_in_flight=[2 * p] * p, max_deferred=[2 * r + 1 for r in range(p)])
    else:
        check_schedule(schedule, max_in_flight=_bounds(p), max_deferred=[b + 1 for b in _bounds(p)])
    if name != "1f1b":  # every B split: its W on the same rank, after it
        for r, actions in enumerate(schedule.ranks):
            for c in range(schedule.num_chunks):
                assert sorted(a.micro for a in actions if a.kind == W and a.chunk == c) == list(range(m)), r


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


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_zbv_bubble_is_within_a_third_of_1f1b(p):
    """Simulated with equal F, B and W per whole stage (half of each per ZBV chunk), at m = 2p and 4p."""
    for m in (2 * p, 4 * p):
        one = simulate(one_f_one_b(p, m), 1.0, 1.0, 1.0)
        zbv = simulate(zero_bubble_v(p, m), 0.5, 0.5, 0.5)
        assert sum(zbv.busy) == pytest.approx(sum(one.busy))  # the same work
        assert (zbv.makespan - m * 3) <= 0.35 * (one.makespan - m * 3), (p, m, zbv.makespan, one.makespan)


def test_a_zbv_w_before_its_b_a_forward_out_of_order_and_the_memory_bound_are_caught():
    schedule = zero_bubble_v(2, 4)
    actions = list(schedule.ranks[1])
    actions.remove(Action(W, 1, 0))
    actions.insert(0, Action(W, 1, 0))
    with pytest.raises(InvalidSchedule, match=r"rank 1 position 0: W0@1 runs before its B"):
        check_schedule(_replace(schedule, 1, actions))
    swapped = list(schedule.ranks[0])
    swapped[0], swapped[1] = swapped[1], swapped[0]  # F1 before F0 of chunk 0: messages out of order
    with pytest.raises(InvalidSchedule, match=r"rank 0 position 0: F1 runs before micro-batch 0's"):
        check_schedule(_replace(schedule, 0, swapped))
    # rank 0 runs every chunk-0 forward before its first backward: 5 chunk micro-batches in flight > 2p = 4
    eager = [Action(F, 0, i) for i in range(4)] + [a for a in schedule.ranks[0] if a not in
                                                   [Action(F, 0, i) for i in range(4)]]
    check_schedule(_replace(schedule, 0, eager))  # valid without the bound
    with pytest.raises(InvalidSchedule, match=r"rank 0 position \d+: after F\d@1 it holds 5 micro-batches' "
                                              r"activations, over the bound 4"):
        check_schedule(_replace(schedule, 0, eager), max_in_flight=[4, 4])


@pytest.mark.parametrize("p, m", [(2, 4), (3, 7), (4, 8)])
def test_exchange_rounds_pair_each_send_with_its_receive(p, m):
    schedule = zero_bubble_v(p, m)
    rounds = exchange_rounds(schedule)
    assert len({len(r) for r in rounds}) == 1  # every rank goes through every round
    for r in range(p):
        assert [x.action for x in rounds[r] if x.action is not None] == schedule.ranks[r]
        for t, step in enumerate(rounds[r]):
            for peer, message in step.sends:  # received by the peer in this same round
                assert (r, message) in rounds[peer][t].receives
                assert message[1] == schedule.virtual_stage(r, step.action.chunk)
    backwards_first = [Action(B, 0, 0)] + [a for a in schedule.ranks[0] if a != Action(B, 0, 0)]
    with pytest.raises(InvalidSchedule, match="deadlocks"):
        exchange_rounds(_replace(schedule, 0, backwards_first))


def test_the_split_runner_takes_1f1b_order_only():
    schedule = zero_bubble_h1(2, 4)
    last = [Action(kind, 0, i) for i in range(4) for kind in (F, B, W)]  # F B W, one micro-batch at a time
    assert _weights_after(_replace(schedule, 1, last), 1) == {1: [0], 3: [1], 5: [2], 7: [3]}
    swapped = list(schedule.ranks[0])
    swapped[0], swapped[1] = swapped[1], swapped[0]
    with pytest.raises(ValueError, match="rank 0's forwards and backwards are not in 1F1B's order"):
        _weights_after(_replace(schedule, 0, swapped), 0)
