"""The expert-parallel dimension of the grid: group membership in Megatron core's rank order."""

from __future__ import annotations

import pytest

from megazero.parallel_state import grid_groups


def test_ep_groups_dp4_ep2():
    # TP=PP=1: the EP group is 2 consecutive DP ranks, expert-DP the ranks with the same EP index
    groups = grid_groups(4, expert_model_parallel_size=2)
    assert groups["dp"] == [(0, 1, 2, 3)]
    assert groups["ep"] == [(0, 1), (2, 3)]
    assert groups["expert_dp"] == [(0, 2), (1, 3)]


def test_ep_groups_tp2_dp4_ep2():
    # rank = dp_rank * 2 + tp_rank: EP peers share the TP rank
    groups = grid_groups(8, tensor_model_parallel_size=2, expert_model_parallel_size=2)
    assert groups["dp"] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert groups["ep"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert groups["expert_dp"] == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_ep_groups_tp2_pp2_dp2_ep2():
    # each pipeline stage is a block of tp * dp = 4 ranks; EP = DP: one expert replica per expert
    groups = grid_groups(8, 2, 2, 2)
    assert groups["ep"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert groups["expert_dp"] == [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)]
    assert groups["pp"] == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_ep_groups_dp8_ep4_pp2():
    groups = grid_groups(16, pipeline_model_parallel_size=2, expert_model_parallel_size=4)
    assert groups["ep"] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert groups["expert_dp"] == [(0, 4), (1, 5), (2, 6), (3, 7), (8, 12), (9, 13), (10, 14), (11, 15)]


def test_ep_one_adds_no_groups():
    assert set(grid_groups(4, 2)) == {"tp", "dp", "pp", "mp"}


def test_ep_must_divide_dp():
    with pytest.raises(ValueError, match=r"data-parallel size 2 .* not divisible by expert_model_parallel_size \(4\)"):
        grid_groups(4, tensor_model_parallel_size=2, expert_model_parallel_size=4)


@pytest.mark.parametrize("world, tp, pp, ep, error", [
    # EP splits DP only: with TP and PP taking the ranks, too few are left (the message names all sizes)
    (8, 2, 2, 4, r"data-parallel size 2 \(world size 8 / tensor_model_parallel_size 2 / "
                 r"pipeline_model_parallel_size 2\) is not divisible by expert_model_parallel_size \(4\)"),
    (12, 2, 1, 4, r"data-parallel size 6 .* not divisible by expert_model_parallel_size \(4\)"),
    (8, 1, 8, 2, r"data-parallel size 1 .* not divisible by expert_model_parallel_size \(2\)"),
    (4, 1, 1, 0, r"expert_model_parallel_size must be at least 1, got 0"),
    (6, 4, 1, 1, r"world size 6 is not divisible by tensor_model_parallel_size \(4\) x pipeline_model_parallel_size"),
])
def test_ep_validated_against_tp_dp_pp(world, tp, pp, ep, error):
    with pytest.raises(ValueError, match=error):
        grid_groups(world, tp, pp, ep)
