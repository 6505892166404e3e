"""docs/benchmarks.md is generated from benchmarks/results/*.json (`python -m benchmarks.report`,
`make docs`): the committed page must be what the command writes from the committed results, and
every result file records the run that made it (benchmarks/record.py)."""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil

import pytest

from benchmarks import record, report

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULT_FILES = sorted(glob.glob(os.path.join(report.RESULTS, "*.json")))


def committed_page() -> str:
    with open(report.PAGE) as f:
        return f.read()


def test_committed_page_is_generated_from_committed_results():
    assert committed_page() == report.generate(report.RESULTS), (
        "docs/benchmarks.md differs from what `python -m benchmarks.report` generates: run `make docs`")
    assert report.main(["--check"]) == 0


def test_a_changed_result_changes_the_page(tmp_path):
    """A value changed in a copy of the results makes the page differ from the committed one, and
    `--check` against the committed page fails."""
    assert RESULT_FILES, "benchmarks/results/ holds no result"
    copy = tmp_path / "results"
    shutil.copytree(report.RESULTS, copy)
    path = copy / "zero.json" if (copy / "zero.json").exists() else copy / os.path.basename(RESULT_FILES[0])
    data = json.loads(path.read_text())
    rows = data.get("rows")
    if isinstance(rows, dict) and "tokens_per_s" in next(iter(rows.values())):
        next(iter(rows.values()))["tokens_per_s"] *= 1.5  # a table value
    else:
        data["meta"]["date"] = "1999-01-01 00:00 UTC"
    path.write_text(json.dumps(data))
    assert report.generate(str(copy)) != committed_page()
    assert report.main(["--check", "--results", str(copy)]) == 1
    assert report.main(["--check", "--results", report.RESULTS]) == 0


@pytest.mark.parametrize("path", RESULT_FILES, ids=[os.path.basename(p) for p in RESULT_FILES])
def test_each_result_records_its_run(path):
    with open(path) as f:
        meta = json.load(f)["meta"]
    assert meta["machine"]["cpu"] and meta["machine"]["cores"] >= 1
    assert meta["torch"] and meta["date"]
    assert meta["command"].startswith("python benchmarks/"), meta["command"]
    assert isinstance(meta["args"], dict)


def test_page_lists_every_result_and_says_what_was_not_run(tmp_path):
    """A benchmark without a result file is listed as not run; a result of no known benchmark still
    gets a section."""
    empty = tmp_path / "empty"
    empty.mkdir()
    page = report.generate(str(empty))
    assert page.count("(not run on this machine)") == len(report.SECTIONS)
    other = tmp_path / "other"
    other.mkdir()
    (other / "something_new.json").write_text(json.dumps({"rows": {"a": {"x": 1.0}}, "meta": {}}))
    assert "### something_new" in report.generate(str(other))


def test_write_result_adds_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", [os.path.join(REPO, "benchmarks", "bench_zero.py"), "--trials", "4"])
    out = tmp_path / "x.json"
    args = argparse.Namespace(trials=4, data_path=os.path.join(REPO, "data", "gpt2", "shakespeare"))
    record.write_result("x", {"rows": {"a": {"tokens_per_s": 1.0}}}, args=args, out=str(out))
    data = json.loads(out.read_text())
    assert data["benchmark"] == "x" and data["rows"] == {"a": {"tokens_per_s": 1.0}}
    assert data["meta"]["command"] == "python benchmarks/bench_zero.py --trials 4"
    assert data["meta"]["args"] == {"trials": 4, "data_path": os.path.join("data", "gpt2", "shakespeare")}
    assert data["meta"]["torch"] and data["meta"]["machine"]["cores"] >= 1


def test_zero_benchmark_names_a_configuration_whose_losses_differ():
    from benchmarks.bench_zero import loss_verdict

    rows = {"zero0": {"losses": [9.0, 8.0], "max_abs_loss_diff": 0.0},
            "zero3": {"losses": [9.0, 8.0001], "max_abs_loss_diff": 1e-4},
            "ds0": {"losses": [9.0, 3.1], "max_abs_loss_diff": 4.9}}
    verdict = loss_verdict(rows, list(rows), 2)
    assert verdict.startswith("losses: equal in 2 configurations at each of 2 steps within 1.00e-04")
    assert verdict.endswith("; differ by more than 1%: DeepSpeed ZeRO-0 (by up to 4.9)")
    assert loss_verdict({k: rows[k] for k in ("zero0", "zero3")}, ["zero0", "zero3"], 2).count("differ") == 0
