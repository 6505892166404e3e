"""megazero.accelerator: DeepSpeed's accelerator interface on the CPU (this machine), the one device
choice init_distributed and the recipes use, DS_ACCELERATOR, and the CUDA accelerator's answers where
a GPU is present."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megazero import accelerator as acc
from megazero.distributed import resolve_backend, training_device

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def fresh(monkeypatch):
    """The process's accelerator chosen again (and put back afterwards)."""
    previous = acc._accelerator
    monkeypatch.setattr(acc, "_accelerator", None)
    yield monkeypatch
    acc._accelerator = previous


def test_cpu_accelerator_answers_as_a_training_script_asks(fresh):
    fresh.setenv("DS_ACCELERATOR", "cpu")
    a = acc.get_accelerator()
    assert acc.get_accelerator() is a  # one object for the process
    assert (a.device_name(), a.device_name(1), a.current_device_name(), a.current_device()) == ("cpu", "cpu", "cpu", 0)
    assert a.device(3) == torch.device("cpu") and a.device_count() == 1 and a.is_available()
    assert a.communication_backend_name() == "gloo" and a.is_bf16_supported() and a.is_fp16_supported()
    a.set_device(0)
    a.synchronize()
    a.empty_cache()
    a.reset_peak_memory_stats()
    a.manual_seed(7)
    first = torch.rand(4)
    a.manual_seed_all(7)
    assert torch.equal(torch.rand(4), first)
    t = torch.ones(3)
    assert a.pin_memory(t) is t and a.on_accelerator(t)
    before = a.memory_allocated()
    block = torch.ones(64 * 2 ** 20, dtype=torch.uint8)  # 64 MiB, written: resident
    assert a.memory_allocated() >= before + 60 * 2 ** 20
    peak = a.max_memory_allocated()
    assert peak >= before + 60 * 2 ** 20
    del block
    a.reset_peak_memory_stats()
    assert a.max_memory_allocated() <= peak - 32 * 2 ** 20  # the 64 MiB block is gone and so is its peak


def test_the_accelerator_is_the_one_device_choice(fresh):
    fresh.setenv("DS_ACCELERATOR", "cpu")
    fresh.delenv("MEGAZERO_DIST_BACKEND", raising=False)
    assert resolve_backend() == "gloo" and training_device(local_rank=1) == torch.device("cpu")
    fresh.setattr(acc, "_accelerator", acc.CUDAAccelerator())  # what a GPU host chooses
    fresh.setattr(torch.cuda, "device_count", lambda: 2)
    assert training_device(local_rank=3) == torch.device("cuda", 1)  # local rank 3 of 2 visible GPUs
    assert acc.get_accelerator().device_name(1) == "cuda:1" and acc.get_accelerator().device_name() == "cuda"


def test_ds_accelerator_names_a_known_one(fresh):
    fresh.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu': megazero has the 'cpu' and 'cuda' accelerators"):
        acc.get_accelerator()
    if not torch.cuda.is_available():
        fresh.setenv("DS_ACCELERATOR", "cuda")
        with pytest.raises(ValueError, match="torch sees no GPU"):
            acc.get_accelerator()


def test_the_default_is_cuda_exactly_when_torch_sees_a_gpu():
    code = "from megazero.accelerator import get_accelerator; print(get_accelerator().device_name())"
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert out.stdout.strip() == ("cuda" if torch.cuda.is_available() else "cpu"), out.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU and a CUDA build of torch")
def test_cuda_accelerator_on_a_gpu(fresh):
    fresh.delenv("DS_ACCELERATOR", raising=False)
    a = acc.get_accelerator()
    a.set_device(0)
    assert a.current_device_name() == "cuda:0" and a.communication_backend_name() == "nccl"
    x = torch.ones(2 ** 20, device="cuda")
    assert a.on_accelerator(x) and a.memory_allocated() >= 4 * 2 ** 20
    assert a.pin_memory(torch.ones(4)).is_pinned()
    a.synchronize()
