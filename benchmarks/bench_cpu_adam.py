"""The optimizer phase on CPU at the memory-bandwidth limit: megazero's fused C++ op against torch.

For N parameters (default 100M), each measured side by side in one run (alternating trials,
median), on 1 and on 2 threads:
  bandwidth   in-place axpy y += a * x (12 bytes per element, the op's vectorised OpenMP loop):
              the machine's ceiling
  fp32 Adam   megazero op vs torch.optim.AdamW(fused=True): 28 bytes per parameter
  bf16 phase  the engine's mixed-precision optimizer phase: gradient norm + inf/nan check,
              unscale/clip, AdamW on the fp32 master, bf16 working copy written.
              megazero: norm kernel + one fused pass (4 + 30 bytes per parameter);
              torch A: vector_norm + fused AdamW (grad_scale) + cast pass (4 + 28 + 6);
              torch B: vector_norm + unscale pass + fused AdamW + cast pass (4 + 8 + 28 + 6)
              DeepSpeedCPUAdam (where deepspeed is installed, e.g. by `make bench`): its step over the
              fp32 master with ZeRO-Offload's separate unscale and bf16 copy passes (torch B's bytes)
GB/s counts those bytes; 'of bw' is the fraction of the measured axpy bandwidth. Writes
benchmarks/results/cpu_adam.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.record import write_result
from megazero.ops.cpu_optimizers import FusedCPUAdam, cpu_optimizers_op, grad_norm_squared

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BYTES = {"axpy": 12, "megazero fp32 Adam": 28, "torch fused AdamW": 28, "megazero bf16 phase": 34,
         "torch bf16 phase A": 38, "torch bf16 phase B": 46, "DeepSpeedCPUAdam fp32": 28,
         "DeepSpeedCPUAdam bf16 phase": 46}


def make_cases(n: int) -> dict:
    torch.manual_seed(0)
    x, y = torch.randn(n), torch.randn(n)
    grad = torch.randn(n) * 1e-3
    op = cpu_optimizers_op()
    cases = {"axpy": lambda: op.axpy(y, x, 1e-6)}

    def master():
        return torch.nn.Parameter(torch.randn(n) * 0.02)

    ours_p, torch_p = master(), master()
    ours_p.grad, torch_p.grad = grad, grad.clone()
    ours = FusedCPUAdam([ours_p], lr=1e-4, weight_decay=0.1, use_op=True)
    reference = torch.optim.AdamW([torch_p], lr=1e-4, weight_decay=0.1, fused=True)
    cases["megazero fp32 Adam"] = ours.step
    cases["torch fused AdamW"] = reference.step

    mixed_p, a_p, b_p = master(), master(), master()
    for p in (mixed_p, a_p, b_p):
        p.grad = grad.clone()
    copy16 = torch.empty(n, dtype=torch.bfloat16)
    mixed = FusedCPUAdam([mixed_p], lr=1e-4, weight_decay=0.1, use_op=True)
    mixed.set_copy_targets({id(mixed_p): copy16})
    torch_a = torch.optim.AdamW([a_p], lr=1e-4, weight_decay=0.1, fused=True)
    torch_b = torch.optim.AdamW([b_p], lr=1e-4, weight_decay=0.1, fused=True)
    scale = 1024.0

    def megazero_phase():
        norm = grad_norm_squared([mixed_p.grad]) ** 0.5 / scale
        assert norm == norm and norm != float("inf")
        mixed.grad_scale = scale
        mixed.step()

    def torch_phase_a():
        norm = float(torch.linalg.vector_norm(a_p.grad)) / scale
        assert norm == norm and norm != float("inf")
        torch_a.grad_scale = torch.tensor(scale)
        torch_a.step()
        torch_a.grad_scale = None
        copy16.copy_(a_p)

    def torch_phase_b():
        norm = float(torch.linalg.vector_norm(b_p.grad)) / scale
        assert norm == norm and norm != float("inf")
        b_p.grad.mul_(1.0 / scale)
        torch_b.step()
        b_p.grad.mul_(scale)  # keep the gradient unchanged between trials (timed, not counted in its bytes)
        copy16.copy_(b_p)

    cases["megazero bf16 phase"] = megazero_phase
    cases["torch bf16 phase A"] = torch_phase_a
    cases["torch bf16 phase B"] = torch_phase_b
    cases.update(deepspeed_cases(n, grad))
    return cases


def deepspeed_cases(n: int, grad: torch.Tensor) -> dict:
    """DeepSpeedCPUAdam's rows where deepspeed imports. Its step() (0.19.8) only updates the fp32
    master: ZeRO-Offload unscales/clips the gradient in a pass of its own (unscale_and_clip_grads)
    and copies the master into the 16-bit partition after the step, so its phase is torch B's shape."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # not installed here: the rows are left out
        return {}
    p = torch.nn.Parameter(torch.randn(n) * 0.02)
    p.grad = grad.clone()
    fp32 = DeepSpeedCPUAdam([p], lr=1e-4, weight_decay=0.1)
    q = torch.nn.Parameter(torch.randn(n) * 0.02)
    q.grad = grad.clone()
    mixed = DeepSpeedCPUAdam([q], lr=1e-4, weight_decay=0.1)
    copy16 = torch.empty(n, dtype=torch.bfloat16)
    scale = 1024.0

    def phase():
        norm = float(torch.linalg.vector_norm(q.grad)) / scale
        assert norm == norm and norm != float("inf")
        q.grad.mul_(1.0 / scale)
        mixed.step()
        q.grad.mul_(scale)  # as torch B: the gradient unchanged between trials
        copy16.copy_(q)

    return {"DeepSpeedCPUAdam fp32": fp32.step, "DeepSpeedCPUAdam bf16 phase": phase}


def measure(n: int, trials: int) -> dict:
    cases = make_cases(n)
    for fn in cases.values():  # warm-up (states allocated, pages touched)
        fn()
    times = {name: [] for name in cases}
    for _ in range(trials):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def child(n: int, trials: int, threads: int) -> dict:
    """Measure in a fresh process with `threads` OpenMP/torch threads."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    code = (f"import json, torch; torch.set_num_threads({threads}); import benchmarks.bench_cpu_adam as b; "
            f"print(json.dumps(b.measure({n}, {trials})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "cpu_adam.json"))
    args = parser.parse_args()
    if cpu_optimizers_op() is None:
        sys.exit("the cpu_optimizers op could not be built here; nothing to measure")
    n = int(args.params)
    results = {}
    print(f"{n / 1e6:.0f}M fp32 parameters, ISA {cpu_optimizers_op().isa()}, median of {args.trials} "
          f"alternating trials")
    for threads in (1, 2):
        times = child(n, args.trials, threads)
        bandwidth = BYTES["axpy"] * n / times["axpy"]
        rows = {}
        for name, seconds in times.items():
            gbps = BYTES[name] * n / seconds
            rows[name] = {"ms": 1000 * seconds, "GB/s": gbps / 1e9, "of_bandwidth": gbps / bandwidth}
        for base in ("torch fused AdamW", "DeepSpeedCPUAdam fp32"):
            if base in times:
                rows["megazero fp32 Adam"][f"vs {base}"] = times[base] / times["megazero fp32 Adam"]
        for base in ("torch bf16 phase A", "torch bf16 phase B", "DeepSpeedCPUAdam bf16 phase"):
            if base in times:
                rows["megazero bf16 phase"][f"vs {base}"] = times[base] / times["megazero bf16 phase"]
        results[f"{threads} thread{'s' if threads > 1 else ''}"] = rows
        print(f"\n{threads} thread(s): measured bandwidth {bandwidth / 1e9:.1f} GB/s")
        print(f"{'row':<30}{'ms':>9}{'GB/s':>8}{'of bw':>8}  speed-up")
        for name, row in rows.items():
            extra = ", ".join(f"{k} {v:.2f}x" for k, v in row.items() if k.startswith("vs "))
            print(f"{name:<30}{row['ms']:>9.1f}{row['GB/s']:>8.1f}{row['of_bandwidth']:>8.2f}  {extra}")
    write_result("cpu_adam", {"params": n, "isa": cpu_optimizers_op().isa(), "results": results}, args=args,
                 out=args.out)


if __name__ == "__main__":
    main()
