"""`make check-gpu`: everything that needs a GPU, in one command sized for a 15-minute GPU lease.

On a lent GPU machine (no package index: carry .whl/, made here by `make gpu-wheels`) the one
command is, from the repository root:

    python3 scripts/check_gpu.py

It installs the carried wheels (.whl/) into /tmp/megazero-site and puts them first on every child's
PYTHONPATH, checks that megazero and its dependencies import and which tools are there (one line
each), then runs the steps below, each in its own process group under its share of the time budget
(default 300 s: the caps add up to it, so one run and a rerun fit 15 minutes with the machine's
start). A step the budget cannot reach is reported as not run; a step that overruns is killed with
its whole process group; a step that raises is reported, and the rest go on.

  build        the ops (cpu_optimizers and cuda_kernels, built side by side, MEGAZERO_OPS_STRICT=1)
  cuda tests   pytest -m cuda over tests/ops (kernels against their references, the optimizers
               against the CPU op, parameter offload's GPU path, NCCL paths) and test_peak_flops.py
  fused GPT    benchmarks/gpu_train.py fused: the CPU-sized GPT with fused_kernels on / off,
               fp32 and bf16; losses within the kernels' tolerances, MFU below 100%
  ZeRO nccl    benchmarks/gpu_train.py zero: stages 0-3 at world size 1 over NCCL, against gloo
  gpu ops      benchmarks/gpu_ops.py: each kernel against torch's own op at GPT-2 XL shapes
  GPT-2 124M   benchmarks/gpu_train.py gpt2: tokens/s and MFU in bf16 (goal: MFU >= 45%)
  multi-rank   with 2+ GPUs, 2 NCCL ranks (ZeRO-2 data parallel, 2 pipeline stages, 2
               tensor-parallel ranks) against the same on gloo; with one GPU, listed as not run

Once the steps start, prints a table (step, result, seconds, numbers). The logs and summary.json
go to --out; where $OUT is set (the GPU lending tool's output folder) and --out is not, they go to a
temporary folder, and $OUT gets summary.json and check_gpu_logs.tar.gz (the folder is removed).
Exit status 0: every step that ran passed; 1: a step failed; 2: no GPU (the plan is printed) or
something missing (named).
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET

import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARRIED_WHEELS = os.path.join(REPO, ".whl")
SITE = "/tmp/megazero-site"  # where the carried wheels are installed
BUDGET_S = 300.0
# each step's cap in seconds, in order: they add up to BUDGET_S
CAPS = {"build": 110.0, "cuda tests": 70.0, "fused GPT": 30.0, "ZeRO nccl vs gloo": 30.0, "gpu ops": 25.0,
        "GPT-2 124M": 35.0}
MULTI_RANK_CAP = 60.0  # only with 2+ GPUs, and only when time is left
NOT_RUN_WITH_ONE_GPU = ("NCCL across ranks: pipeline p2p (1F1B, 2 stages), ZeRO-2 data parallel over 2 ranks, "
                        "tensor parallel over 2 ranks (each needs one GPU per rank)")
TOOLS = ("nvcc", "ninja", "c++")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every step: the repository first on PYTHONPATH, then whatever was there
    (the carried wheels), never replaced."""
    before = os.environ.get("PYTHONPATH", "")
    path = os.pathsep.join([REPO] + ([before] if before else []))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(extra or {})}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class Check:
    """The steps' results and the time budget they share."""

    def __init__(self, out_dir: str, budget: float):
        self.out_dir, self.deadline, self.start = out_dir, time.monotonic() + budget, time.monotonic()
        self.rows: list[dict] = []
        os.makedirs(out_dir, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, step: str, result: str, seconds: float, numbers: str) -> None:
        self.rows.append({"step": step, "result": result, "seconds": round(seconds, 1), "numbers": numbers})
        print(f"[check-gpu] {step}: {result} ({seconds:.0f} s) {numbers}", flush=True)

    def log_path(self, step: str) -> str:
        return os.path.join(self.out_dir, step.replace(" ", "_") + ".log")

    def spawn(self, argv: list[str], log, env: dict[str, str] | None = None) -> subprocess.Popen:
        """argv in a session of its own (so a timeout takes its whole process group: the compilers a
        build started, the ranks a multi-rank step spawned), output to the open file `log`."""
        return subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=child_env(env))

    def run(self, step: str, argv: list[str], limit: float, env: dict | None = None) -> tuple[int | None, float]:
        """argv under min(limit, time left); (exit status or None when it ran out of time, seconds).
        Its output goes to <out>/<step>.log."""
        start = time.monotonic()
        with open(self.log_path(step), "w") as log:
            proc = self.spawn(argv, log, env)
            try:
                rc = proc.wait(timeout=max(min(limit, self.left()), 0.1))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc = None
        return rc, time.monotonic() - start

    def tail(self, step: str, lines: int = 15) -> str:
        try:
            with open(self.log_path(step)) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def fits(self, step: str, needs: float) -> bool:
        """Whether `needs` seconds are left; otherwise the step is reported as not run."""
        if self.left() >= needs:
            return True
        self.add(step, "NOT RUN", 0.0, f"time budget: {self.left():.0f} s left, the step needs about {needs:.0f}")
        return False

    def guarded(self, step: str, fn, *args) -> None:
        """fn(self, *args); an exception becomes the step's row (ERROR), the next steps still run."""
        start = time.monotonic()
        try:
            fn(self, *args)
        except Exception as e:  # noqa: BLE001  (any failure is reported, never lost)
            self.add(step, "ERROR", time.monotonic() - start, f"{type(e).__name__}: {e}")


def _json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _result(rc: int | None) -> str:
    return "PASS" if rc == 0 else ("TIMEOUT" if rc is None else "FAIL")


def step_build(check: Check) -> None:
    """Both ops at once (one compiler process each), strict: a failed build fails the step."""
    start = time.monotonic()
    code = "import sys; from megazero.ops.builder import load_op; sys.exit(load_op(sys.argv[1]) is None)"
    failed = []
    with open(check.log_path("build"), "w") as log:
        procs = {name: check.spawn([sys.executable, "-c", code, name], log, {"MEGAZERO_OPS_STRICT": "1"})
                 for name in ("cpu_optimizers", "cuda_kernels")}
        for name, proc in procs.items():
            try:
                if proc.wait(timeout=max(min(CAPS["build"] - (time.monotonic() - start), check.left()), 0.1)):
                    failed.append(name)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                failed.append(f"{name} (timed out)")
    check.add("build", "FAIL" if failed else "PASS", time.monotonic() - start,
              f"not built: {', '.join(failed)}" if failed else "cpu_optimizers, cuda_kernels")
    if failed:
        print(check.tail("build", 30))


def step_cuda_tests(check: Check) -> None:
    """pytest -m cuda; the counts and the first failures from its JUnit XML."""
    if not check.fits("cuda tests", 30):
        return
    xml = os.path.join(check.out_dir, "cuda_tests.xml")
    rc, seconds = check.run("cuda tests", [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                                           f"--junitxml={xml}", "tests/ops", "tests/unit/test_peak_flops.py"],
                            CAPS["cuda tests"])
    counts, failures = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}, []
    try:
        root = ET.parse(xml).getroot()
        for suite in root.iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
        for case in root.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failures.append(f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}")
    except (OSError, ET.ParseError):
        pass
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    numbers = (f"{passed} passed, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped"
               + (f"; failed: {', '.join(failures[:8])}" if failures else ""))
    check.add("cuda tests", _result(rc), seconds, numbers)
    if rc != 0:
        print(check.tail("cuda tests", 25))


def _train_step(check: Check, name: str, mode: str, needs_s: float) -> tuple | None:
    """benchmarks/gpu_train.py MODE as check step NAME, if NEEDS_S seconds are left:
    (return code, seconds, its JSON result), or None when skipped."""
    if not check.fits(name, needs_s):
        return None
    out = os.path.join(check.out_dir, f"{mode}.json")
    rc, seconds = check.run(name, [sys.executable, "-m", "benchmarks.gpu_train", mode, "--json", out], CAPS[name])
    return rc, seconds, _json(out)


def step_fused(check: Check) -> None:
    """Engine steps of the CPU-sized GPT with fused kernels on and off."""
    ran = _train_step(check, "fused GPT", "fused", 20)
    if ran is None:
        return
    rc, seconds, r = ran
    parts = []
    for precision in ("fp32", "bf16"):
        if precision in r:
            p = r[precision]
            worst = max(p["max_rel_loss_diff"].values())
            parts.append(f"{precision}: loss diff {worst:.1e} (tol {p['rtol']:.0e}), {p['tokens_per_s']:,.0f} tok/s, "
                         f"MFU {100 * p['mfu']:.1f}%")
    check.add("fused GPT", _result(rc), seconds,
              "; ".join(parts) or check.tail("fused GPT", 3).strip().replace("\n", " | "))


def step_zero(check: Check) -> None:
    """ZeRO 0-3 at world size 1: NCCL against gloo, stage by stage."""
    if not check.fits("ZeRO nccl vs gloo", 20):
        return
    runs, seconds = {}, 0.0
    for backend in ("nccl", "gloo"):
        out = os.path.join(check.out_dir, f"zero_{backend}.json")
        argv = [sys.executable, "-m", "benchmarks.gpu_train", "zero", backend, "--json", out]
        rc, s = check.run(f"zero {backend}", argv, CAPS["ZeRO nccl vs gloo"] / 2)
        seconds += s
        runs[backend] = _json(out).get("losses") if rc == 0 else None
    if runs["nccl"] is None or runs["gloo"] is None:
        broken = [b for b in runs if runs[b] is None]
        check.add("ZeRO nccl vs gloo", "FAIL", seconds, f"{', '.join(broken)} run failed: "
                  + check.tail(f"zero {broken[0]}", 3).strip().replace("\n", " | "))
        return
    diffs = {stage: max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(runs["nccl"][stage], runs["gloo"][stage]))
             for stage in runs["nccl"]}
    ok = all(d <= 1e-6 for d in diffs.values())
    check.add("ZeRO nccl vs gloo", "PASS" if ok else "FAIL", seconds,
              "max rel loss diff per stage " + ", ".join(f"{s}: {d:.1e}" for s, d in diffs.items()))


def step_gpu_ops(check: Check) -> None:
    """benchmarks/gpu_ops.py: correctness and speed-up of each kernel against torch's op."""
    if not check.fits("gpu ops", 20):
        return
    out = os.path.join(check.out_dir, "gpu_ops.json")
    rc, seconds = check.run("gpu ops", [sys.executable, "-m", "benchmarks.gpu_ops", "--json", out], CAPS["gpu ops"])
    rows = _json(out).get("rows", {})
    wrong = [name for name, r in rows.items() if not r["correct"]]
    numbers = ", ".join(f"{name.split(' (')[0]} x{r['speedup']:.2f}" for name, r in rows.items())
    if wrong:
        numbers = f"incorrect: {', '.join(wrong)}; " + numbers
    check.add("gpu ops", _result(rc), seconds, numbers or check.tail("gpu ops", 3).strip().replace("\n", " | "))


def step_gpt2(check: Check) -> None:
    """GPT-2 124M tokens/s and MFU (bf16); the 45% goal is reported, not failed."""
    ran = _train_step(check, "GPT-2 124M", "gpt2", 25)
    if ran is None:
        return
    rc, seconds, r = ran
    if rc != 0 or not r:
        check.add("GPT-2 124M", _result(rc), seconds, check.tail("GPT-2 124M", 3).strip().replace("\n", " | "))
        return
    result = "PASS" if r["mfu"] >= r["goal_mfu"] else "BELOW GOAL"
    check.add("GPT-2 124M", result, seconds, f"{r['tokens_per_s']:,.0f} tokens/s, MFU {100 * r['mfu']:.1f}% "
              f"(goal {100 * r['goal_mfu']:.0f}%, peak {r['peak_tflops']:.0f} TFLOP/s, micro-batch {r['micro_batch']})")


def step_multi_rank(check: Check, gpus: int) -> None:
    """2 NCCL ranks against 2 gloo ranks where there are 2 GPUs; otherwise say what is not run."""
    if gpus < 2:
        check.add("multi-rank", "NOT RUN", 0.0, f"{gpus} GPU visible: {NOT_RUN_WITH_ONE_GPU}")
        return
    if not check.fits("multi-rank", 40):
        return
    runs, seconds = {}, 0.0
    for backend in ("nccl", "gloo"):
        out = os.path.join(check.out_dir, f"multi_{backend}.json")
        rc, s = check.run(f"multi {backend}", [sys.executable, "-m", "benchmarks.gpu_train", "multi", backend,
                                               "--json", out], MULTI_RANK_CAP / 2)
        seconds += s
        runs[backend] = _json(out) if rc == 0 else None
    if runs["nccl"] is None or runs["gloo"] is None:
        broken = [b for b in runs if runs[b] is None]
        check.add("multi-rank", "FAIL", seconds, f"{', '.join(broken)} run failed: "
                  + check.tail(f"multi {broken[0]}", 3).strip().replace("\n", " | "))
        return
    diffs = {name: max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(runs["nccl"]["losses"][name], losses))
             for name, losses in runs["gloo"]["losses"].items()}
    ok = all(d <= 1e-4 for d in diffs.values())  # GPU against CPU arithmetic, fp32
    check.add("multi-rank", "PASS" if ok else "FAIL", seconds,
              "max rel loss diff NCCL (GPU) vs gloo (CPU): " + ", ".join(f"{n} {d:.1e}" for n, d in diffs.items()))


STEPS = [("build", step_build), ("cuda tests", step_cuda_tests), ("fused GPT", step_fused),
         ("ZeRO nccl vs gloo", step_zero), ("gpu ops", step_gpu_ops), ("GPT-2 124M", step_gpt2)]


# ---- before the steps ------------------------------------------------------------------------------
def install_carried_wheels(wheels_dir: str = CARRIED_WHEELS, site: str = SITE) -> str | None:
    """Install .whl/'s wheels (no index, no dependencies: the set is complete) into `site` and put it
    first on sys.path and PYTHONPATH; a line saying what was done (None: no wheels carried)."""
    wheels = sorted(glob.glob(os.path.join(wheels_dir, "*.whl")))
    if not wheels:
        return None
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--no-cache-dir", "--upgrade", "--target", site, *wheels], capture_output=True, text=True)
    if pip.returncode != 0:  # the preflight then names what is missing
        return f"the carried wheels in {wheels_dir} did not install: {pip.stderr.strip().splitlines()[-1:]}"
    sys.path.insert(0, site)
    before = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([site] + ([before] if before else []))
    importlib.invalidate_caches()
    return f"{len(wheels)} carried wheels installed into {site}"


def runtime_modules(pyproject: str = os.path.join(REPO, "pyproject.toml"),
                    wheel_list: str = os.path.join(REPO, "ci", "gpu_wheels.txt")) -> list[str]:
    """The import names of megazero's runtime dependencies, less those ci/gpu_wheels.txt says are not
    carried (nothing a check runs imports them)."""
    with open(pyproject, "rb") as f:
        names = [re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0] for r in tomllib.load(f)["project"]["dependencies"]]
    with open(wheel_list) as f:
        skipped = {m.group(1) for m in re.finditer(r"^# not carried: ([\w.-]+)", f.read(), re.MULTILINE)}
    return [n.replace("-", "_").lower() for n in names if n not in skipped]


def tool_lines() -> list[str]:
    """`command -v` of the build's tools, and nvcc's version."""
    lines = [f"{tool}: {shutil.which(tool) or 'NOT FOUND'}" for tool in TOOLS]
    if shutil.which("nvcc"):
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
        release = re.search(r"release ([\d.]+)", out)
        lines.append(f"nvcc version: {release.group(1) if release else out.strip()[-80:]}")
    return lines


def import_problem(module: str) -> str | None:
    """Why `module` does not import in a step's environment (child_env: the repository, then the
    carried wheels), as one line; None when it does."""
    run = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=REPO, env=child_env(), capture_output=True,
                         text=True)
    if run.returncode == 0:
        return None
    return (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]


def preflight() -> tuple[str | None, int, list[str]]:
    """(what is missing, or None; GPUs visible; lines about this machine). Finds every runtime
    dependency and imports megazero as the steps will, first, so that a missing one is one line,
    not a traceback after a build."""
    lines = [f"python {sys.version.split()[0]} ({sys.executable})"]
    missing = [m for m in runtime_modules() + ["pytest"] if importlib.util.find_spec(m) is None]
    if importlib.util.find_spec("ninja") is None and not shutil.which("ninja"):
        missing.append("ninja")
    lines += tool_lines()
    if "torch" in missing:
        return (f"python modules missing: {', '.join(missing)} (run it with a python that has torch: on the GPU "
                f"machines, python3)"), 0, lines
    import torch

    lines.append(f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    problem = import_problem("megazero")
    if problem:
        missing.insert(0, f"megazero ({problem})")
    if missing:
        return (f"python modules missing: {', '.join(missing)} (carry them: `make gpu-wheels` where pip reaches an "
                f"index, then .whl/ to this machine)"), 0, lines
    if torch.version.cuda is None or not torch.cuda.is_available():
        return "no GPU (or a CPU build of torch): nothing to check here", 0, lines
    gpus = torch.cuda.device_count()
    lines.append(f"{gpus} x {torch.cuda.get_device_name(0)}")
    return None, gpus, lines


def plan(budget: float) -> list[str]:
    """The steps and their caps, as they would run under `budget`."""
    out, left = [], budget
    for name, _ in STEPS:
        cap = min(CAPS[name], max(left, 0.0))
        out.append(f"{name:<20} cap {CAPS[name]:>4.0f} s" + ("" if cap == CAPS[name] else
                                                            f" (budget leaves {cap:.0f} s)"))
        left -= CAPS[name]
    out.append(f"{'multi-rank':<20} cap {MULTI_RANK_CAP:>4.0f} s (2+ GPUs, time left)")
    return out


def print_table(check: Check) -> None:
    print(f"\n{'step':<20}{'result':<12}{'s':>6}  numbers")
    for r in check.rows:
        print(f"{r['step']:<20}{r['result']:<12}{r['seconds']:>6.0f}  {r['numbers']}")
    print(f"total {time.monotonic() - check.start:.0f} s")


def write_outputs(out_dir: str, summary: dict, out_env: str | None, temporary: bool = False) -> None:
    """summary.json into `out_dir`; where $OUT is set, summary.json and a tarball of `out_dir` there
    (`temporary`: `out_dir` is then removed)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if out_env:
        os.makedirs(out_env, exist_ok=True)
        shutil.copy(os.path.join(out_dir, "summary.json"), os.path.join(out_env, "summary.json"))
        with tarfile.open(os.path.join(out_env, "check_gpu_logs.tar.gz"), "w:gz") as tar:
            tar.add(out_dir, arcname="check_gpu")
    if temporary:
        shutil.rmtree(out_dir, ignore_errors=True)


def main(argv=None) -> int:
    """Run the steps in order under the budget; the exit status (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="where the logs, JSON results and summary.json go (default: a "
                   "temporary folder where $OUT is set, else benchmarks/results/check_gpu)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for all steps (default {BUDGET_S:.0f})")
    args = p.parse_args(argv)
    out_env = os.environ.get("OUT") or None
    temporary = args.out is None and out_env is not None  # the logs then live in $OUT's tarball only
    out_dir = args.out or (tempfile.mkdtemp(prefix="check_gpu-") if temporary else
                           os.path.join(REPO, "benchmarks", "results", "check_gpu"))
    carried = install_carried_wheels()
    problem, gpus, machine = preflight()
    for line in ([carried] if carried else []) + machine:
        print(f"[check-gpu] {line}", flush=True)
    print(f"[check-gpu] plan, budget {args.budget:.0f} s:\n  " + "\n  ".join(plan(args.budget)), flush=True)
    summary = {"machine": machine, "budget_s": args.budget, "plan": plan(args.budget), "rows": []}
    if problem:
        print(f"[check-gpu] {problem}")
        write_outputs(out_dir, {**summary, "problem": problem}, out_env, temporary)
        return 2
    check = Check(out_dir, args.budget)
    try:
        built = True
        for name, step in STEPS:
            if not built:
                check.add(name, "NOT RUN", 0.0, "the build failed")
                continue
            check.guarded(name, step)
            built = name != "build" or check.rows[-1]["result"] == "PASS"
        check.guarded("multi-rank", step_multi_rank, gpus)
    finally:
        print_table(check)
        write_outputs(out_dir, {**summary, "rows": check.rows}, out_env, temporary)
    return 1 if any(r["result"] in ("FAIL", "TIMEOUT", "ERROR") for r in check.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
