"""benchmarks/bench_context.py runs its three modes at a short sequence and writes its result: the
sample's first loss is the same at CP=1 and CP=2 (both attention paths), and CP=2 keeps fewer
activations per rank. Timings are the benchmark's, not this test's."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_context_benchmark_runs_its_modes_with_equal_losses(tmp_path):
    from benchmarks.bench_context import main

    main(["--seq-lengths", "256", "--steps", "1", "--out", str(tmp_path / "context.json")])
    rows = json.loads((tmp_path / "context.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["cp1", "cp2_p2p", "cp2_a2a"]
    assert rows[1]["first_loss"] == pytest.approx(rows[0]["first_loss"], rel=1e-5)
    assert rows[2]["first_loss"] == pytest.approx(rows[0]["first_loss"], rel=1e-5)
    assert all(r["activation_vs_cp1"] < 1 for r in rows[1:])
