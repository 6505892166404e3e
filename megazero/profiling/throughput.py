"""Model FLOPs per token (Megatron/nanoGPT formula) and a measured matmul peak for MFU."""

from __future__ import annotations

import json
import os
import time

import torch


def gpt_flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_length: int) -> float:
    """Training FLOPs per token: 6N for the weights plus 12*L*d*T for attention (fwd + bwd)."""
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_length


def measure_peak_flops(dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.5,
                       cache_path: str | None = None) -> float:
    """FLOP/s of a square torch.mm on this process's threads (cached in `cache_path` when given)."""
    key = f"{torch.__version__}|{dtype}|{size}|{torch.get_num_threads()}"
    if cache_path and os.path.exists(cache_path):
        with open(cache_path) as f:
            cached = json.load(f)
        if key in cached:
            return float(cached[key])
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        calls += 1
    peak = 2.0 * size ** 3 * calls / (time.perf_counter() - start)
    if cache_path:
        cached = {}
        if os.path.exists(cache_path):
            with open(cache_path) as f:
                cached = json.load(f)
        cached[key] = peak
        os.makedirs(os.path.dirname(cache_path) or ".", exist_ok=True)
        tmp = f"{cache_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cached, f)
        os.replace(tmp, cache_path)
    return peak
