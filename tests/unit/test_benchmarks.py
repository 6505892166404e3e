"""The benchmarks' DeepSpeed rows run against the pinned DeepSpeed (the `bench` extra): its
CPU Adam's API, and megazero's and DeepSpeed's engines under one loop. Skipped, saying how to
enable them, where deepspeed is not installed."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import bench_cpu_adam

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed", reason="deepspeed is not installed: `pip install -e .[bench]` (or `make bench`) "
                                        "enables this test")


def test_deepspeed_cpu_adam_rows_step():
    cases = bench_cpu_adam.deepspeed_cases(1000, torch.randn(1000) * 1e-3)
    assert set(cases) == {"DeepSpeedCPUAdam fp32", "DeepSpeedCPUAdam bf16 phase"}
    fp32, phase = cases["DeepSpeedCPUAdam fp32"], cases["DeepSpeedCPUAdam bf16 phase"]
    optimizer = fp32.__self__
    before = optimizer.param_groups[0]["params"][0].detach().clone()
    fp32()
    phase()
    assert not torch.equal(optimizer.param_groups[0]["params"][0], before)
    assert set(bench_cpu_adam.BYTES) >= set(cases)
