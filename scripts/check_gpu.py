"""`make check-gpu`: everything that needs a GPU, in one command of at most 8 minutes on one GPU.

Steps, each in its own process under a share of the time budget (a step that would not fit is
reported as not run):
  build        the ops (cpu_optimizers and cuda_kernels, built side by side, MEGAZERO_OPS_STRICT=1)
  cuda tests   pytest -m cuda over tests/ops (kernels against their references; empty,
               non-contiguous, broadcast-mask and wrong-device inputs; fully masked rows; causal
               sq != sk; fp16 near overflow; the optimizers against the CPU op; every op on a
               non-default stream; bitwise reproducibility; parameter offload's GPU path, device
               cpu and nvme, bit for bit in-memory stage 3, partitions on the host between uses:
               tests/ops/test_param_offload_cuda.py) and tests/unit/test_peak_flops.py
  fused GPT    benchmarks/gpu_train.py fused: the CPU-sized GPT with fused_kernels on / off,
               fp32 and bf16; losses within the kernels' tolerances, MFU below 100%
  ZeRO nccl    benchmarks/gpu_train.py zero: stages 0-3 at world size 1 over NCCL, against gloo
  gpu ops      benchmarks/gpu_ops.py: each kernel against torch's own op at GPT-2 XL shapes
  GPT-2 124M   benchmarks/gpu_train.py gpt2: tokens/s and MFU in bf16 (goal: MFU >= 45%)
  multi-rank   with 2+ GPUs, 2 NCCL ranks (ZeRO-2 data parallel, 2 pipeline stages, 2
               tensor-parallel ranks) against the same on gloo; with one GPU, listed as not run

Prints a table (step, result, seconds, numbers) and writes it with every step's log under --out.
Installs nothing (a GPU machine often reaches no package index): run it with a python whose torch
is a CUDA build and that has numpy, pytest and ninja (`make check-gpu GPU_PYTHON=...`). Exit
status 1 if a step failed, 2 where there is no GPU or a module is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEEDED_MODULES = ("torch", "numpy", "pytest", "ninja")  # ninja: the module or the program (the ops' JIT build)
NOT_RUN_WITH_ONE_GPU = ("NCCL across ranks: pipeline p2p (1F1B, 2 stages), ZeRO-2 data parallel over 2 ranks, "
                        "tensor parallel over 2 ranks (each needs one GPU per rank)")


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

    def run(self, step: str, argv: list[str], limit: float, env: dict | None = None) -> tuple[int | None, float]:
        """argv under min(limit, time left); (exit status or None when it ran out of time, seconds).
        Its output goes to OUT/<step>.log."""
        timeout = min(limit, self.left())
        log = os.path.join(self.out_dir, step.replace(" ", "_") + ".log")
        start = time.monotonic()
        with open(log, "w") as f:
            # a session of its own: on a timeout the step's whole process group goes (the ranks
            # a multi-rank step spawned too, which would otherwise hold their GPUs)
            proc = subprocess.Popen(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1", **(env or {})})
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        return rc, time.monotonic() - start

    def tail(self, step: str, lines: int = 15) -> str:
        with open(os.path.join(self.out_dir, step.replace(" ", "_") + ".log")) as f:
            return "".join(f.readlines()[-lines:])

    def fits(self, step: str, needs: float) -> bool:
        """Whether `needs` seconds are left; otherwise the step is reported as not run."""
        if self.left() >= needs:
            return True
        self.add(step, "NOT RUN", 0.0, f"time budget: {self.left():.0f} s left, the step needs about {needs:.0f}")
        return False


def _json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def step_build(check: Check) -> bool:
    """Both ops at once (one compiler process each), strict: a failed build fails the step."""
    start = time.monotonic()
    code = "import sys; from megazero.ops.builder import load_op; sys.exit(load_op(sys.argv[1]) is None)"
    env = {**os.environ, "PYTHONPATH": REPO, "MEGAZERO_OPS_STRICT": "1"}
    procs = {name: subprocess.Popen([sys.executable, "-c", code, name], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for name in ("cpu_optimizers", "cuda_kernels")}
    failed = []
    with open(os.path.join(check.out_dir, "build.log"), "w") as log:
        for name, proc in procs.items():
            try:
                out, _ = proc.communicate(timeout=max(check.left(), 1))
                if proc.returncode != 0:
                    failed.append(name)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                failed.append(f"{name} (timed out)")
            log.write(f"---- {name}\n{out}")
    seconds = time.monotonic() - start
    check.add("build", "FAIL" if failed else "PASS", seconds,
              f"not built: {', '.join(failed)}" if failed else "cpu_optimizers, cuda_kernels")
    if failed:
        print(check.tail("build", 30))
    return not failed


def step_cuda_tests(check: Check) -> None:
    """pytest -m cuda; the counts and the first failures from its JUnit XML."""
    if not check.fits("cuda tests", 60):
        return
    xml = os.path.join(check.out_dir, "cuda_tests.xml")
    rc, seconds = check.run("cuda tests", [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                                           f"--junitxml={xml}", "tests/ops", "tests/unit/test_peak_flops.py"], 270)
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
    result = "PASS" if rc == 0 else ("TIMEOUT" if rc is None else "FAIL")
    check.add("cuda tests", result, seconds, numbers)
    if rc != 0:
        print(check.tail("cuda tests", 25))


def _train_step(check: Check, name: str, mode: str, needs_s: float) -> tuple | None:
    """benchmarks/gpu_train.py MODE as check step NAME, if NEEDS_S seconds are left:
    (return code, seconds, its JSON result), or None when skipped."""
    if not check.fits(name, needs_s):
        return None
    out = os.path.join(check.out_dir, f"{mode}.json")
    rc, seconds = check.run(name, [sys.executable, "benchmarks/gpu_train.py", mode, "--json", out], 150)
    return rc, seconds, _json(out)


def step_fused(check: Check) -> None:
    """Engine steps of the CPU-sized GPT with fused kernels on and off."""
    ran = _train_step(check, "fused GPT", "fused", 30)
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
    check.add("fused GPT", "PASS" if rc == 0 else ("TIMEOUT" if rc is None else "FAIL"), seconds,
              "; ".join(parts) or check.tail("fused GPT", 3).strip().replace("\n", " | "))


def step_zero(check: Check) -> None:
    """ZeRO 0-3 at world size 1: NCCL against gloo, stage by stage."""
    if not check.fits("ZeRO nccl vs gloo", 40):
        return
    runs, seconds = {}, 0.0
    for backend in ("nccl", "gloo"):
        out = os.path.join(check.out_dir, f"zero_{backend}.json")
        argv = [sys.executable, "benchmarks/gpu_train.py", "zero", backend, "--json", out]
        rc, s = check.run(f"zero {backend}", argv, 90)
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
    if not check.fits("gpu ops", 40):
        return
    out = os.path.join(check.out_dir, "gpu_ops.json")
    rc, seconds = check.run("gpu ops", [sys.executable, "benchmarks/gpu_ops.py", "--json", out], 200)
    rows = _json(out).get("rows", {})
    wrong = [name for name, r in rows.items() if not r["correct"]]
    numbers = ", ".join(f"{name.split(' (')[0]} x{r['speedup']:.2f}" for name, r in rows.items())
    if wrong:
        numbers = f"incorrect: {', '.join(wrong)}; " + numbers
    check.add("gpu ops", "PASS" if rc == 0 else ("TIMEOUT" if rc is None else "FAIL"), seconds,
              numbers or check.tail("gpu ops", 3).strip().replace("\n", " | "))


def step_gpt2(check: Check) -> None:
    """GPT-2 124M tokens/s and MFU (bf16); the 45% goal is reported, not failed."""
    ran = _train_step(check, "GPT-2 124M", "gpt2", 40)
    if ran is None:
        return
    rc, seconds, r = ran
    if rc != 0 or not r:
        check.add("GPT-2 124M", "TIMEOUT" if rc is None else "FAIL", seconds,
                  check.tail("GPT-2 124M", 3).strip().replace("\n", " | "))
        return
    result = "PASS" if r["mfu"] >= r["goal_mfu"] else "BELOW GOAL"
    check.add("GPT-2 124M", result, seconds, f"{r['tokens_per_s']:,.0f} tokens/s, MFU {100 * r['mfu']:.1f}% "
              f"(goal {100 * r['goal_mfu']:.0f}%, peak {r['peak_tflops']:.0f} TFLOP/s, micro-batch {r['micro_batch']})")


def step_multi_rank(check: Check, gpus: int) -> None:
    """2 NCCL ranks against 2 gloo ranks where there are 2 GPUs; otherwise say what is not run."""
    if gpus < 2:
        check.add("multi-rank", "NOT RUN", 0.0, f"{gpus} GPU visible: {NOT_RUN_WITH_ONE_GPU}")
        return
    if not check.fits("multi-rank", 60):
        return
    runs, seconds = {}, 0.0
    for backend in ("nccl", "gloo"):
        out = os.path.join(check.out_dir, f"multi_{backend}.json")
        rc, s = check.run(f"multi {backend}", [sys.executable, "benchmarks/gpu_train.py", "multi", backend, "--json",
                                               out], 150)
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


def preflight() -> tuple[str | None, int, str]:
    """(what is missing or None, GPUs visible, a line about this machine)."""
    missing = [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None and not (m == "ninja" and
                                                                                        shutil.which("ninja"))]
    if "torch" in missing:
        return f"python modules missing: {', '.join(missing)}", 0, sys.executable
    import torch

    line = f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})"
    also = f" (python modules missing as well: {', '.join(missing)})" if missing else ""
    if torch.version.cuda is None or not torch.cuda.is_available():
        return f"no GPU (or a CPU build of torch): nothing to check here{also}", 0, line
    if missing:
        return f"python modules missing: {', '.join(missing)} (install them into {sys.executable})", 0, line
    gpus = torch.cuda.device_count()
    return None, gpus, f"{line}, {gpus} x {torch.cuda.get_device_name(0)}"


def print_table(check: Check) -> None:
    print(f"\n{'step':<20}{'result':<12}{'s':>6}  numbers")
    for r in check.rows:
        print(f"{r['step']:<20}{r['result']:<12}{r['seconds']:>6.0f}  {r['numbers']}")
    print(f"total {time.monotonic() - check.start:.0f} s")


def main(argv=None) -> int:
    """Run the steps in order under the budget; the exit status (1: a step failed)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "check_gpu"),
                   help="where the logs, JSON results and summary.json go")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all steps (default 480)")
    args = p.parse_args(argv)
    problem, gpus, machine = preflight()
    print(f"[check-gpu] {machine}", flush=True)
    if problem:
        print(f"[check-gpu] {problem}")
        return 2
    check = Check(args.out, args.budget)
    if step_build(check):
        step_cuda_tests(check)
        step_fused(check)
        step_zero(check)
        step_gpu_ops(check)
        step_gpt2(check)
        step_multi_rank(check, gpus)
    print_table(check)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"machine": machine, "rows": check.rows}, f, indent=1)
    return 1 if any(r["result"] in ("FAIL", "TIMEOUT") for r in check.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
