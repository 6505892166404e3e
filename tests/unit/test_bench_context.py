"""benchmarks/bench_context.py runs its three modes at a short sequence and writes its result: the
sample's first loss is the same at CP=1 and CP=2 (both attention paths), and CP=2 keeps fewer
activations per rank. Its longest-sequence search: a step under a cap too small for it reports
the allocation error instead of a result (and the same step uncapped runs), and the search finds
the largest length a predicate allows. Timings are the benchmark's, not this test's."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_context_benchmark_runs_its_modes_with_equal_losses(tmp_path):
    from benchmarks.bench_context import main

    main(["--seq-lengths", "256", "--steps", "1", "--cap-gib", "0", "--out", str(tmp_path / "context.json")])
    rows = json.loads((tmp_path / "context.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["cp1", "cp2_p2p", "cp2_a2a"]
    assert rows[1]["first_loss"] == pytest.approx(rows[0]["first_loss"], rel=1e-5)
    assert rows[2]["first_loss"] == pytest.approx(rows[0]["first_loss"], rel=1e-5)
    assert all(r["activation_vs_cp1"] < 1 for r in rows[1:])


def test_a_step_under_too_small_a_cap_reports_the_error():
    from benchmarks.bench_context import measure

    assert "error" in measure(256, 1, "p2p", 0, cap_bytes=2**30)
    assert "error" not in measure(256, 1, "p2p", 0)


def test_the_search_finds_the_longest_length_that_fits():
    from benchmarks.bench_context import search_longest

    tries = []

    def fits(n: int) -> bool:
        tries.append(n)
        return n <= 5000

    assert search_longest(fits, 2048, 512) == 4608
    assert tries[:3] == [2048, 4096, 8192]  # doubling, then bisection
    assert search_longest(lambda n: False, 2048, 512) == 0
