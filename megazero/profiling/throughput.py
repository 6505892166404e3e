"""Model FLOPs per token (Megatron/nanoGPT formula) and a measured matmul peak for MFU.

The peak is a property of the machine, so it is measured once per machine and kept in the user's
cache directory (`$XDG_CACHE_HOME/megazero/peak_flops.json`, else `~/.cache/megazero/`), never in
the repository: a clone carried to another machine, or a home directory shared between machines,
then measures afresh wherever the key (CPU model, threads and torch version, or GPU name) differs.
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch

CACHE_FILE = "peak_flops.json"
# big enough to reach a GPU's tensor-core peak; a CPU reaches its BLAS peak at 1024 already
DEFAULT_SIZE = {"cpu": 1024, "cuda": 8192}


def gpt_flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_length: int) -> float:
    """Training FLOPs per token: 6N for the weights plus 12*L*d*T for attention (fwd + bwd)."""
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_length


def peak_cache_path() -> str:
    """The per-user file that holds measured peaks: under $XDG_CACHE_HOME, else ~/.cache."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "megazero", CACHE_FILE)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else what platform reports)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def matmul_precision(device_type: str, dtype: torch.dtype) -> str:
    """The dtype as the peak depends on it: on a GPU, fp32 matmuls run on the tensor cores (TF32)
    when torch allows it, at several times the plain fp32 peak, so the setting is part of it."""
    if device_type == "cuda" and dtype == torch.float32:
        return f"{dtype} tf32={'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}"
    return str(dtype)


def machine_key(device: torch.device, dtype: torch.dtype, size: int) -> str:
    """What a measured peak depends on: the device type and the GPU's name, or the CPU model and
    this process's threads; the torch version (its BLAS), the dtype (and TF32) and the matrix size."""
    if device.type == "cuda":
        where = f"cuda {torch.cuda.get_device_name(device)}"
    else:
        where = f"cpu {cpu_model()} x{torch.get_num_threads()} threads"
    return f"{where}|torch {torch.__version__}|{matmul_precision(device.type, dtype)}|{size}"


def _read_cache(path: str) -> dict:
    try:
        with open(path) as f:
            cached = json.load(f)
    except (OSError, ValueError):  # absent, or cut short by a crash: measure again
        return {}
    return cached if isinstance(cached, dict) else {}


def _write_cache(path: str, key: str, peak: float) -> None:
    cached = _read_cache(path)
    cached[key] = peak
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # ranks of one node may write at once: each replaces whole
    with open(tmp, "w") as f:
        json.dump(cached, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _time_matmuls(device: torch.device, dtype: torch.dtype, size: int, seconds: float) -> float:
    """FLOP/s of repeated square matmuls on `device`, timed across device synchronisations (the
    fastest of five slices of `seconds`)."""
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    out = torch.empty(size, size, dtype=dtype, device=device)
    torch.mm(a, b, out=out)  # warm-up: BLAS / cuBLAS handles, kernel selection
    sync()
    per_sync = 10 if cuda else 1  # GPU launches are asynchronous: queue a few, then wait for them
    best = 0.0
    # the best of 5 slices: another process's burst on a shared machine lowers some slices, not the peak
    for _ in range(5):
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 5:
            for _ in range(per_sync):
                torch.mm(a, b, out=out)
            sync()
            calls += per_sync
        best = max(best, 2.0 * size ** 3 * calls / (time.perf_counter() - start))
    return best


def measure_peak_flops(dtype: torch.dtype = torch.float32, size: int | None = None, seconds: float = 0.5,
                       device: torch.device | str | None = None, cache: bool = True,
                       cache_path: str | None = None) -> float:
    """FLOP/s of a square matmul: on the GPU where `device` is (or defaults to) CUDA, else on this
    process's CPU threads. Cached per machine key in `cache_path` (default `peak_cache_path()`)
    unless `cache=False`."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in DEFAULT_SIZE:
        raise ValueError(f"measure_peak_flops: device {device} is neither cpu nor cuda")
    size = size or DEFAULT_SIZE[device.type]
    path = cache_path or peak_cache_path()
    key = machine_key(device, dtype, size)
    if cache and key in (cached := _read_cache(path)):
        return float(cached[key])
    peak = _time_matmuls(device, dtype, size, seconds)
    if cache:
        _write_cache(path, key, peak)
    return peak
