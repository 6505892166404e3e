"""Check and time megazero's CUDA kernels on a GPU in one run (a few minutes): each op against its
pure-torch reference (fp32 1e-5, bf16 1e-2 relative), then its time, effective GB/s (or TFLOP/s)
and the fraction of the device's bandwidth measured by a large copy. Prints a table, writes
benchmarks/results/gpu_ops.json. Exits with a message where there is no GPU.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from megazero.ops import cuda_ops

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(fn, repeats: int = 20) -> float:
    """Median seconds of fn() over CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


def main() -> None:
    if torch.version.cuda is None or not torch.cuda.is_available():
        sys.exit("no GPU (or a CPU build of torch): nothing to check here")
    if cuda_ops.cuda_op() is None:
        sys.exit("the cuda_kernels op did not build; see `python -m megazero.ops report`")
    torch.manual_seed(0)
    big = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    copy_seconds = timed(lambda: big.clone())
    bandwidth = 2 * big.numel() / copy_seconds
    rows = {}

    def row(name: str, fused, reference, bytes_moved: int, check) -> None:
        ok = check(fused(), reference())
        fused_s, ref_s = timed(fused), timed(reference)
        rows[name] = {"correct": bool(ok), "fused_ms": 1e3 * fused_s, "reference_ms": 1e3 * ref_s,
                      "speedup": ref_s / fused_s, "GB/s": bytes_moved / fused_s / 1e9,
                      "of_bandwidth": bytes_moved / fused_s / bandwidth}

    def close(dtype):
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        return lambda a, b: torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)

    def kernels(dtype) -> None:
        tag = str(dtype).split(".")[-1]
        x = torch.randn(8192, 4096, device="cuda", dtype=dtype)
        w, b = torch.ones(4096, device="cuda", dtype=dtype), torch.zeros(4096, device="cuda", dtype=dtype)
        size = x.numel() * x.element_size()
        row(f"layer_norm fwd {tag}", lambda: cuda_ops.layer_norm(x, w, b),
            lambda: cuda_ops.layer_norm_reference(x, w, b, 1e-5), 2 * size, close(dtype))
        scores = torch.randn(8, 16, 1024, 1024, device="cuda", dtype=dtype)
        mask = torch.rand(8, 1, 1024, 1024, device="cuda") < 0.1
        ssize = scores.numel() * scores.element_size()
        row(f"masked softmax fwd {tag}", lambda: cuda_ops.scaled_masked_softmax(scores, mask, 0.125),
            lambda: cuda_ops.softmax_reference(scores, mask, 0.125, False), 2 * ssize, close(dtype))
        row(f"causal softmax fwd {tag}", lambda: cuda_ops.scaled_upper_triang_masked_softmax(scores, 0.125),
            lambda: cuda_ops.softmax_reference(scores, None, 0.125, True), 2 * ssize, close(dtype))
        hb = torch.randn(4096, device="cuda", dtype=dtype)
        row(f"bias_gelu fwd {tag}", lambda: cuda_ops.bias_gelu(x, hb), lambda: cuda_ops.bias_gelu_reference(x, hb),
            2 * size, close(dtype))
    for dtype in (torch.float32, torch.bfloat16):
        kernels(dtype)
    params = [torch.nn.Parameter(torch.randn(1 << 22, device="cuda")) for _ in range(32)]
    for p in params:
        p.grad = torch.randn_like(p)
    fused = cuda_ops.FusedCUDAAdam(params, lr=1e-4)
    reference = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-4,
                                  weight_decay=0.0, foreach=True)
    for q, p in zip(reference.param_groups[0]["params"], params):
        q.grad = p.grad.clone()
    row("multi-tensor Adam (134M params)", fused.step, reference.step, 28 * 32 * (1 << 22), lambda a, b: True)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'op':<34}{'ok':>4}{'fused ms':>10}{'torch ms':>10}{'speed-up':>10}{'GB/s':>8}{'of bw':>7}")
    for name, r in rows.items():
        print(f"{name:<34}{'yes' if r['correct'] else 'NO':>4}{r['fused_ms']:>10.3f}{r['reference_ms']:>10.3f}"
              f"{r['speedup']:>10.2f}{r['GB/s']:>8.0f}{r['of_bandwidth']:>7.2f}")
    out = os.path.join(REPO, "benchmarks", "results", "gpu_ops.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "rows": rows}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
