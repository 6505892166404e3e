"""The matmul peak behind MFU: measured per machine into the user's cache directory (never the
repository), keyed by CPU model, threads and torch version (or the GPU's name), and on a GPU
measured on the GPU."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megazero.profiling import throughput
from megazero.profiling.throughput import machine_key, measure_peak_flops, peak_cache_path

QUICK = dict(size=64, seconds=0.02)


@pytest.fixture()
def home(tmp_path, monkeypatch):
    """A fresh HOME with no XDG_CACHE_HOME, so the default location is the user's ~/.cache."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return tmp_path / "home"


def _entries(path) -> dict:
    with open(path) as f:
        return json.load(f)


def test_default_cache_is_under_the_users_home(home):
    peak = measure_peak_flops(**QUICK)
    path = home / ".cache" / "megazero" / "peak_flops.json"
    assert peak_cache_path() == str(path)
    assert _entries(path) == {machine_key(torch.device("cpu"), torch.float32, 64): peak}


def test_xdg_cache_home_is_honoured(home, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    measure_peak_flops(**QUICK)
    assert os.path.exists(tmp_path / "xdg" / "megazero" / "peak_flops.json")
    assert not os.path.exists(home / ".cache")


def test_key_names_the_cpu_threads_and_torch_version():
    key = machine_key(torch.device("cpu"), torch.bfloat16, 1024)
    assert throughput.cpu_model() in key and f"x{torch.get_num_threads()} threads" in key
    assert torch.__version__ in key and "torch.bfloat16" in key and key.endswith("|1024")


def test_a_cached_peak_is_reused_only_for_the_same_key(home):
    measure_peak_flops(**QUICK)
    path = peak_cache_path()
    key = machine_key(torch.device("cpu"), torch.float32, 64)
    with open(path, "w") as f:  # a value no 64x64 matmul measures: returned only if read from the cache
        json.dump({key: 1.5}, f)
    assert measure_peak_flops(**QUICK) == 1.5
    assert measure_peak_flops(**QUICK, cache=False) != 1.5  # cache=False measures
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # another machine shape: measured afresh, kept beside the first
        other = measure_peak_flops(**QUICK)
    finally:
        torch.set_num_threads(threads)
    entries = _entries(path)
    assert entries[key] == 1.5 and other != 1.5 and len(entries) == 2


def test_a_corrupt_cache_file_is_measured_over(home):
    path = peak_cache_path()
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write('{"cut short')
    peak = measure_peak_flops(**QUICK)
    assert peak > 0 and list(_entries(path).values()) == [peak]


def test_unknown_device_is_refused(home):
    with pytest.raises(ValueError, match="neither cpu nor cuda"):
        measure_peak_flops(device="meta", **QUICK)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU and a CUDA build of torch")
def test_gpu_peak_is_measured_on_the_gpu(home):
    peak = measure_peak_flops(torch.bfloat16, seconds=0.2)
    (key, value), = _entries(peak_cache_path()).items()
    assert key.startswith(f"cuda {torch.cuda.get_device_name()}") and key.endswith("|8192") and value == peak
    assert peak > measure_peak_flops(torch.bfloat16, device="cpu", size=1024, seconds=0.2, cache=False)


def test_a_gpus_fp32_peak_is_keyed_by_whether_tf32_is_allowed():
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        keys = set()
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            keys.add(throughput.matmul_precision("cuda", torch.float32))
            assert throughput.matmul_precision("cpu", torch.float32) == "torch.float32"
            assert throughput.matmul_precision("cuda", torch.bfloat16) == "torch.bfloat16"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    assert keys == {"torch.float32 tf32=off", "torch.float32 tf32=on"}
