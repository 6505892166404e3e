"""Check and time megazero's CUDA kernels against torch's own ops on a GPU (a minute or two), at
GPT-2 XL shapes: hidden 1600, 25 heads, sequence 1024, micro-batch 8 (8192 tokens), and the
optimizers over GPT-2 XL's parameter shapes (1.56 B parameters; --layers fewer for less memory).

Rows: LayerNorm (F.layer_norm) forward and forward + backward; masked and causal softmax
(masked_fill + torch.softmax) forward; bias + GeLU (F.gelu tanh) forward and forward + backward;
multi-tensor Adam (torch.optim.AdamW(fused=True)) and LAMB (FusedCPULamb's pure-torch reference path, use_op=False)
steps. Each: correct (megazero against the fp32 reference, fp32 1e-5 and 16-bit 1e-2 relative;
the optimizers against torch's after one step), megazero ms, torch ms, speed-up, effective GB/s
and the fraction of the device's bandwidth measured by a large copy. Prints a table and writes
benchmarks/results/gpu_ops.json (or --json). Exits with a message where there is no GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from benchmarks.record import write_result
from megazero.ops import cuda_ops
from megazero.ops.cpu_optimizers import FusedCPULamb

HIDDEN, HEADS, SEQ, MICRO, LAYERS, VOCAB = 1600, 25, 1024, 8, 48, 50304  # GPT-2 XL (vocab padded)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over CUDA events (after one warm-up call)."""
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


def copy_bandwidth() -> float:
    """Bytes per second (read + written) of a 1 GiB device-to-device copy."""
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    return 2 * big.numel() / timed(lambda: big.clone(), 10)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """a matches the fp32 reference b within the kernels' tolerance for `dtype`."""
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    return bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol))


def gpt2_xl_shapes(layers: int) -> list[tuple[int, ...]]:
    """GPT-2 XL's parameter shapes: embeddings, then per layer LayerNorms, QKV, projection, MLP."""
    shapes = [(VOCAB, HIDDEN), (SEQ, HIDDEN)]
    for _ in range(layers):
        shapes += [(HIDDEN,), (HIDDEN,), (3 * HIDDEN, HIDDEN), (3 * HIDDEN,), (HIDDEN, HIDDEN), (HIDDEN,),
                   (HIDDEN,), (HIDDEN,), (4 * HIDDEN, HIDDEN), (4 * HIDDEN,), (HIDDEN, 4 * HIDDEN), (HIDDEN,)]
    return shapes + [(HIDDEN,), (HIDDEN,)]


class Table:
    """The rows of the report, timed against the device's copy bandwidth."""

    def __init__(self, bandwidth: float, repeats: int):
        self.bandwidth, self.repeats, self.rows = bandwidth, repeats, {}

    def add(self, name: str, ours, theirs, bytes_moved: int, correct: bool) -> None:
        ours_s, theirs_s = timed(ours, self.repeats), timed(theirs, self.repeats)
        self.rows[name] = {"correct": bool(correct), "megazero_ms": 1e3 * ours_s, "torch_ms": 1e3 * theirs_s,
                           "speedup": theirs_s / ours_s, "GB/s": bytes_moved / ours_s / 1e9,
                           "of_bandwidth": bytes_moved / ours_s / self.bandwidth}

    def print(self) -> None:
        print(f"{'op':<38}{'ok':>4}{'megazero ms':>12}{'torch ms':>10}{'speed-up':>10}{'GB/s':>8}{'of bw':>7}")
        for name, r in self.rows.items():
            print(f"{name:<38}{'yes' if r['correct'] else 'NO':>4}{r['megazero_ms']:>12.3f}{r['torch_ms']:>10.3f}"
                  f"{r['speedup']:>10.2f}{r['GB/s']:>8.0f}{r['of_bandwidth']:>7.2f}")


def _fwd_bwd(fn, inputs: list[torch.Tensor], upstream: torch.Tensor):
    """A callable running fn forward and backward on leaf copies of `inputs`, and those leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]

    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(upstream)
    return run, leaves


def kernel_rows(table: Table, dtype: torch.dtype) -> None:
    """LayerNorm, softmax and bias + GeLU rows at GPT-2 XL activation shapes in `dtype`."""
    tag = str(dtype).split(".")[-1]
    x = torch.randn(MICRO * SEQ, HIDDEN, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).to(dtype)
    b = (0.1 * torch.randn(HIDDEN, device="cuda")).to(dtype)
    dy = torch.randn_like(x)
    size = x.numel() * x.element_size()
    ref = cuda_ops.layer_norm_reference(x, w, b, 1e-5)
    table.add(f"layer_norm fwd {tag}", lambda: cuda_ops.layer_norm(x, w, b), lambda: F.layer_norm(x, (HIDDEN,), w, b),
              2 * size, close(cuda_ops.layer_norm(x, w, b), ref, dtype))
    ours, ours_leaves = _fwd_bwd(lambda x, w, b: cuda_ops.layer_norm(x, w, b), [x, w, b], dy)
    theirs, ref_leaves = _fwd_bwd(lambda x, w, b: F.layer_norm(x.float(), (HIDDEN,), w.float(), b.float()),
                                  [x, w, b], dy.float())
    ours()
    theirs()
    correct = all(close(a.grad, r.grad, dtype) if i == 0 else
                  torch.allclose(a.grad.float(), r.grad.float(), rtol=1e-2, atol=1e-2)
                  for i, (a, r) in enumerate(zip(ours_leaves, ref_leaves)))
    torch_native, _ = _fwd_bwd(lambda x, w, b: F.layer_norm(x, (HIDDEN,), w, b), [x, w, b], dy)
    table.add(f"layer_norm fwd+bwd {tag}", ours, torch_native, 5 * size, correct)

    scores = torch.randn(MICRO, HEADS, SEQ, SEQ, device="cuda", dtype=dtype)
    padding = torch.rand(MICRO, 1, 1, SEQ, device="cuda") < 0.1  # a padding mask, broadcast over heads and rows
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool, device="cuda").triu(1)
    ssize = scores.numel() * scores.element_size()
    table.add(f"masked softmax fwd {tag}", lambda: cuda_ops.scaled_masked_softmax(scores, padding, 0.125),
              lambda: torch.softmax((scores * 0.125).masked_fill(padding, float("-inf")), -1), 2 * ssize,
              close(cuda_ops.scaled_masked_softmax(scores, padding, 0.125),
                    cuda_ops.softmax_reference(scores, padding, 0.125, False), dtype))
    table.add(f"causal softmax fwd {tag}", lambda: cuda_ops.scaled_upper_triang_masked_softmax(scores, 0.125),
              lambda: torch.softmax((scores * 0.125).masked_fill(causal, float("-inf")), -1), 2 * ssize,
              close(cuda_ops.scaled_upper_triang_masked_softmax(scores, 0.125),
                    cuda_ops.softmax_reference(scores, None, 0.125, True), dtype))

    h = torch.randn(MICRO * SEQ, 4 * HIDDEN, device="cuda", dtype=dtype)
    hb = torch.randn(4 * HIDDEN, device="cuda", dtype=dtype)
    dh = torch.randn_like(h)
    hsize = h.numel() * h.element_size()
    table.add(f"bias_gelu fwd {tag}", lambda: cuda_ops.bias_gelu(h, hb), lambda: F.gelu(h + hb, approximate="tanh"),
              2 * hsize, close(cuda_ops.bias_gelu(h, hb), cuda_ops.bias_gelu_reference(h, hb), dtype))
    ours, ours_leaves = _fwd_bwd(cuda_ops.bias_gelu, [h, hb], dh)
    check, ref_leaves = _fwd_bwd(lambda h, b: cuda_ops.bias_gelu_reference(h.float(), b.float()), [h, hb], dh.float())
    ours()
    check()
    correct = close(ours_leaves[0].grad, ref_leaves[0].grad, dtype)
    torch_native, _ = _fwd_bwd(lambda h, b: F.gelu(h + b, approximate="tanh"), [h, hb], dh)
    table.add(f"bias_gelu fwd+bwd {tag}", ours, torch_native, 5 * hsize, correct)


def optimizer_rows(table: Table, layers: int) -> None:
    """Adam and LAMB steps over GPT-2 XL's parameter shapes (fp32 masters and gradients)."""
    shapes = gpt2_xl_shapes(layers)
    count = sum(torch.Size(s).numel() for s in shapes)

    def params():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
        for p in ps:
            p.grad = torch.randn_like(p) * 1e-3
        return ps

    for name, ours_cls, theirs_cls, kwargs in (
            ("Adam", cuda_ops.FusedCUDAAdam, lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, fused=True),
             {}),
            ("LAMB", cuda_ops.FusedCUDALamb,
             lambda ps: FusedCPULamb(ps, lr=1e-4, weight_decay=0.1, use_op=False), {})):
        ours_params = params()
        ours = ours_cls(ours_params, lr=1e-4, weight_decay=0.1, **kwargs)
        ours.step()
        theirs_params = params()
        theirs = theirs_cls(theirs_params)
        theirs.step()
        correct = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ours_params, theirs_params))
        reference = "AdamW(fused=True)" if name == "Adam" else "Lamb (pure torch)"
        table.add(f"multi-tensor {name} ({count / 1e6:.0f}M) vs {reference}", ours.step, theirs.step, 28 * count,
                  correct)
        del ours, theirs, ours_params, theirs_params
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    """Run every row; 1 if any is incorrect."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=None,
                   help=f"transformer layers of the optimizer rows (default {LAYERS}, fewer if memory is short)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "gpu_ops.json"))
    args = p.parse_args(argv)
    if torch.version.cuda is None or not torch.cuda.is_available():
        sys.exit("no GPU (or a CPU build of torch): nothing to check here")
    if cuda_ops.cuda_op() is None:
        sys.exit("the cuda_kernels op did not build; see `python -m megazero.ops report`")
    bandwidth = copy_bandwidth()
    table = Table(bandwidth, args.repeats)
    for dtype in (torch.float32, torch.bfloat16):
        kernel_rows(table, dtype)
        torch.cuda.empty_cache()
    layers = args.layers
    if layers is None:  # ours and torch's: parameters, gradients and two states each, fp32
        free, _ = torch.cuda.mem_get_info()
        per_layer = 2 * 16 * 12 * HIDDEN * HIDDEN
        layers = max(1, min(LAYERS, int(0.8 * free // per_layer) - 2))
    optimizer_rows(table, layers)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    table.print()
    write_result("gpu_ops", {"device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "optimizer_layers": layers,
                             "rows": table.rows}, args=args, argv=argv, out=args.json)
    return 0 if all(r["correct"] for r in table.rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
