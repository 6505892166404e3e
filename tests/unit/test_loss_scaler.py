"""Dynamic loss scaling: growth after a clean window, hysteresis before halving, the minimum."""

from __future__ import annotations

from megazero.config import FP16Config
from megazero.precision import LossScaler


def _run(scaler: LossScaler, overflows: list[bool]) -> list[float]:
    scales = []
    for overflow in overflows:
        scaler.update(overflow)
        scales.append(scaler.scale)
    return scales


def test_growth_after_window():
    scaler = LossScaler(8.0, dynamic=True, scale_window=3, hysteresis=1)
    assert _run(scaler, [False] * 7) == [8, 8, 16, 16, 16, 32, 32]


def test_hysteresis_delays_halving():
    scaler = LossScaler(64.0, dynamic=True, scale_window=100, hysteresis=3)
    assert _run(scaler, [True, True, True, True]) == [64, 64, 32, 16]
    assert scaler.overflow_count == 4


def test_hysteresis_refills_only_on_growth_unless_consecutive():
    plain = LossScaler(64.0, dynamic=True, scale_window=100, hysteresis=2)
    assert _run(plain, [True, False, True]) == [64, 64, 32]
    consecutive = LossScaler(64.0, dynamic=True, scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    assert _run(consecutive, [True, False, True]) == [64, 64, 64]


def test_window_counts_from_last_overflow():
    scaler = LossScaler(4.0, dynamic=True, scale_window=2, hysteresis=1)
    # DeepSpeed counts iterations from -1: the first growth needs a full window
    assert _run(scaler, [False, True, False, False, False]) == [4, 2, 2, 4, 4]


def test_minimum_scale():
    scaler = LossScaler(4.0, dynamic=True, scale_window=100, hysteresis=1, min_scale=2.0)
    assert _run(scaler, [True, True, True]) == [2, 2, 2]


def test_static_scale_never_changes():
    scaler = LossScaler.from_config(FP16Config(enabled=True, loss_scale=128.0))
    assert _run(scaler, [True, False, False]) == [128, 128, 128]
    assert LossScaler.from_config(FP16Config(enabled=False)).scale == 1.0
    assert LossScaler.from_config(FP16Config(enabled=True, initial_scale_power=10)).scale == 1024


def test_state_dict_round_trip():
    a = LossScaler(64.0, dynamic=True, scale_window=3, hysteresis=2)
    _run(a, [True, False, False])
    b = LossScaler(64.0, dynamic=True, scale_window=3, hysteresis=2)
    b.load_state_dict(a.state_dict())
    assert _run(a, [False, True, True, False]) == _run(b, [False, True, True, False])
