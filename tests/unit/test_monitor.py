"""The monitor writes real TensorBoard event files and offline wandb runs."""

from __future__ import annotations

import os

import pytest

from megazero.config import TensorBoardConfig, WandbConfig
from megazero.monitor import Monitor


def test_tensorboard_scalars_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor = Monitor(TensorBoardConfig(enabled=True, output_path=str(tmp_path), job_name="run"), WandbConfig())
    for step in (1, 2, 3):
        monitor.write(step, {"lm loss": 5.0 / step, "learning-rate": 1e-3 * step})
    monitor.close()
    acc = EventAccumulator(str(tmp_path / "run"))
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("lm loss")] == [(1, 5.0), (2, 2.5), (3, round(5 / 3, 6))]
    assert len(acc.Scalars("learning-rate")) == 3


def test_only_rank_zero_writes(tmp_path):
    monitor = Monitor(TensorBoardConfig(enabled=True, output_path=str(tmp_path), job_name="run"), WandbConfig(),
                      rank=1)
    monitor.write(1, {"lm loss": 1.0})
    monitor.close()
    assert not monitor.enabled and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_wandb_is_offline_without_a_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monitor = Monitor(TensorBoardConfig(), WandbConfig(enabled=True, project="megazero-test"))
    monitor.write(1, {"lm loss": 3.0})
    monitor.close()
    runs = os.listdir(tmp_path / "wandb")
    assert any(name.startswith("offline-run-") for name in runs), runs
