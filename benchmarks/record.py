"""Where the benchmarks write their results: one JSON file per result under benchmarks/results/,
with the run's context beside the numbers (`meta`: the machine, torch, the date, the command line
and the parsed arguments), so that docs/benchmarks.md (`python -m benchmarks.report`) can say what
produced each table.

    write_result("zero", {"rows": ...}, args=args)   # -> benchmarks/results/zero.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys

from megazero.profiling.throughput import cpu_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")


def memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def machine() -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_model(), "cores": cores, "memory_gib": memory_gib(), "os": platform.platform(terse=True)}


def _relative(value):
    """Paths inside the repository as repository-relative ones (the JSON is committed)."""
    if isinstance(value, str) and value.startswith(REPO + os.sep):
        return os.path.relpath(value, REPO)
    if isinstance(value, (list, tuple)):
        return [_relative(v) for v in value]
    if isinstance(value, dict):
        return {k: _relative(v) for k, v in value.items()}
    return value


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran: `python <script relative to the repository> <arguments>`."""
    script = sys.argv[0]
    if script and os.path.exists(script):
        script = os.path.relpath(os.path.abspath(script), REPO)
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["python", script, *[str(_relative(a)) for a in args]])


def meta(args: argparse.Namespace | dict | None = None, argv: list[str] | None = None) -> dict:
    import torch

    parsed = vars(args) if isinstance(args, argparse.Namespace) else (args or {})
    return {"machine": machine(), "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command_line(argv), "args": _relative(dict(parsed)),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def write_result(name: str, payload: dict, *, args=None, argv: list[str] | None = None,
                 out: str | None = None) -> str:
    """Write `payload` and a `meta` block to `out` (default benchmarks/results/<name>.json); returns
    the path. `args`: the parsed arguments (recorded); `argv`: the arguments when main() was called
    with a list rather than the command line."""
    path = out or os.path.join(RESULTS_DIR, f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    record = {"benchmark": name, **{k: _relative(v) for k, v in payload.items() if k != "benchmark"},
              "meta": meta(args, argv)}
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=str)
        f.write("\n")
    print(f"wrote {os.path.relpath(os.path.abspath(path), REPO) if path.startswith(REPO) else path}")
    return path
