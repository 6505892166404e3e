"""Each LR schedule's values against DeepSpeed's formulas, and state_dict round trips."""

from __future__ import annotations

import math

import pytest
import torch

from megazero.optim.lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR


def _optimizer(lr=0.1):
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=lr, betas=(0.9, 0.999))


def _lrs(schedule, steps):
    out = [schedule.optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        schedule.step()
        out.append(schedule.optimizer.param_groups[0]["lr"])
    return out


def test_warmup_lr_log_and_linear():
    lrs = _lrs(WarmupLR(_optimizer(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10), 12)
    assert lrs[0] == 0.0  # before the first step: the minimum
    for i in range(10):
        assert lrs[i + 1] == pytest.approx(math.log(i + 1) / math.log(10))
    assert lrs[11:] == [1.0, 1.0]
    lin = _lrs(WarmupLR(_optimizer(), warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=4,
                        warmup_type="linear"), 5)
    assert lin == pytest.approx([0.1, 0.1, 0.35, 0.6, 0.85, 1.1])


def test_warmup_decay_lr():
    lrs = _lrs(WarmupDecayLR(_optimizer(), total_num_steps=10, warmup_max_lr=1.0, warmup_num_steps=2,
                             warmup_type="linear"), 12)
    # iteration i >= 2: (10 - i) / (10 - 2)
    assert lrs[1:] == pytest.approx([0.0, 0.5] + [(10 - i) / 8 for i in range(2, 11)] + [0.0])


def test_warmup_cosine_lr():
    lrs = _lrs(WarmupCosineLR(_optimizer(lr=2.0), total_num_steps=12, warmup_num_steps=2, cos_min_ratio=0.1,
                              warmup_type="linear", warmup_min_ratio=0.5), 14)
    assert lrs[0] == 0.0
    assert lrs[1:3] == pytest.approx([2.0 * 0.5, 2.0 * 0.75])
    for i in range(2, 14):
        progress = min(1.0, (i - 2 + 1) / 10)
        assert lrs[i + 1] == pytest.approx(2.0 * (0.1 + 0.9 * (1 + math.cos(math.pi * progress)) / 2))
    assert lrs[-1] == pytest.approx(0.2)


def test_one_cycle_lr_and_momentum():
    schedule = OneCycle(_optimizer(), cycle_min_lr=0.1, cycle_max_lr=1.1, cycle_first_step_size=4,
                        decay_lr_rate=0.5, decay_step_size=2, cycle_min_mom=0.8, cycle_max_mom=0.9)
    opt = schedule.optimizer
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["betas"][0] == 0.8
    lrs, moms = [], []
    for _ in range(11):
        schedule.step()
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"][0])
    up = [0.1 + 0.25 * k for k in (1, 2, 3, 4)]
    assert lrs[:8] == pytest.approx(up + [0.85, 0.6, 0.35, 0.1])
    assert lrs[8:] == pytest.approx([0.1 / (1 + 0.5 * k / 2) for k in (1, 2, 3)])
    assert moms[3] == pytest.approx(0.8) and moms[7] == pytest.approx(0.9)
    assert opt.param_groups[0]["betas"][1] == 0.999


def test_one_cycle_staircase():
    schedule = OneCycle(_optimizer(), cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4,
                        cycle_first_stair_count=2, cycle_momentum=False)
    assert _lrs(schedule, 8)[1:] == pytest.approx([0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0])


def test_lr_range_test():
    cont = _lrs(LRRangeTest(_optimizer(), lr_range_test_min_lr=0.01, lr_range_test_step_size=2,
                            lr_range_test_step_rate=1.0), 4)
    assert cont == pytest.approx([0.01, 0.01 * 1.5, 0.01 * 2, 0.01 * 2.5, 0.01 * 3])
    stair = _lrs(LRRangeTest(_optimizer(), lr_range_test_min_lr=0.01, lr_range_test_step_size=2,
                             lr_range_test_staircase=True), 4)
    assert stair == pytest.approx([0.01, 0.01, 0.02, 0.02, 0.03])


@pytest.mark.parametrize("make", [
    lambda o: WarmupLR(o, warmup_num_steps=5),
    lambda o: WarmupDecayLR(o, total_num_steps=20, warmup_num_steps=5),
    lambda o: WarmupCosineLR(o, total_num_steps=20, warmup_num_steps=5),
    lambda o: OneCycle(o, 0.01, 0.1, cycle_first_step_size=3),
    lambda o: LRRangeTest(o),
])
def test_state_dict_round_trip(make):
    first = make(_optimizer())
    for _ in range(7):
        first.step()
    second = make(_optimizer())
    second.load_state_dict(first.state_dict())
    assert second.optimizer.param_groups[0]["lr"] == first.optimizer.param_groups[0]["lr"]
    first.step()
    second.step()
    assert second.optimizer.param_groups[0] == first.optimizer.param_groups[0] | {
        "params": second.optimizer.param_groups[0]["params"]}


def test_one_cycle_cycles_sgd_momentum():
    """SGD has no betas: its `momentum` is what cycles, inverse to the LR, and SGD really uses it."""
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.5)
    schedule = OneCycle(optimizer, cycle_min_lr=0.1, cycle_max_lr=1.1, cycle_first_step_size=4,
                        cycle_min_mom=0.8, cycle_max_mom=0.9)
    moms = [optimizer.param_groups[0]["momentum"]]
    for _ in range(8):
        param.grad = torch.ones(2)
        optimizer.step()
        schedule.step()
        moms.append(optimizer.param_groups[0]["momentum"])
    assert moms == pytest.approx([0.8, 0.875, 0.85, 0.825, 0.8, 0.825, 0.85, 0.875, 0.9])
    assert "betas" not in optimizer.param_groups[0]
    # the buffer follows the cycled momentum: after step k, buf = m_k * buf + 1 with m_k as set before step k
    buffer = 1.0
    for m in moms[1:8]:
        buffer = m * buffer + 1.0
    assert optimizer.state[param]["momentum_buffer"][0].item() == pytest.approx(buffer)


def test_one_cycle_without_any_momentum_names_the_key_and_optimizer():
    from megazero.optim.lr_schedules import build_scheduler

    adagrad = torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match=r"cycle_momentum is true but the optimizer Adagrad has neither"):
        build_scheduler("OneCycle", adagrad, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1})
    schedule = build_scheduler("OneCycle", adagrad, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                                                     "cycle_momentum": False})
    schedule.step()
    assert adagrad.param_groups[0]["lr"] > 0.01
