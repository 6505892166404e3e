"""Fused RMSNorm on CPU (csrc/cpu_norms.cpp, OpenMP), forward and backward in one pass each.

Measured against torch's F.rms_norm + autograd at the Llama's shape 8x256x384 (forward + backward,
2 threads, torch 2.13): 4.6-6.3x faster in fp32 and 6.6x in bf16 on this project's 2-core CPU
machine (the medians of 7 runs, interleaved), so the Llama's `fused_kernels` uses it on CPU.
Its reference is cuda_ops.rms_norm_reference (F.rms_norm in fp32): fp32 within 1e-5, bf16 within
1e-2 (tests/ops/test_cpu_norms.py). The weight gradient is summed in fixed row chunks, then the
chunks in order, so it does not depend on the thread count; below 32768 elements one thread
runs it (a team's wake-up costs more than the work). Inputs the op
does not take (fp16, fp64, mixed dtypes, empty) and a failed build run F.rms_norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megazero.ops import kernel_checks
from megazero.ops.builder import load_op
from megazero.ops.cuda_ops import _RMSNorm

CPU_DTYPES = (torch.float32, torch.bfloat16)


def cpu_norms_op():
    """The compiled CPU op, or None (build failed: F.rms_norm runs instead)."""
    return load_op("cpu_norms")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension of a CPU tensor (the fused op where built and it takes the
    inputs); eps None: torch's default (the dtype's eps)."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    if x.device.type == "cpu" and kernel_checks.rms_norm_takes_kernel(x, weight, CPU_DTYPES):
        op = cpu_norms_op()
        if op is not None:
            return _RMSNorm.apply(x, weight, eps, op)
    return F.rms_norm(x, x.shape[-1:], weight, eps)
