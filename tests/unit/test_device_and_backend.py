"""Which GPU a rank trains on (local rank modulo the visible GPUs) and which process-group backend
it uses (the argument, else $MEGAZERO_DIST_BACKEND, else NCCL on a CUDA host)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megazero.distributed import BACKEND_ENV, resolve_backend, select_device_index, training_device

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("local_rank, device_count, index", [
    (0, 8, 0), (7, 8, 7),  # torchrun on an 8-GPU node: one GPU per rank
    (3, 1, 0),  # srun --gpus-per-task=1 / --gpu-bind: each task sees its own GPU as device 0
    (5, 4, 1), (4, 4, 0),  # more ranks than visible GPUs: they share them in turn
])
def test_device_index_is_the_local_rank_modulo_the_visible_gpus(local_rank, device_count, index):
    assert select_device_index(local_rank, device_count) == index
    assert training_device(local_rank, device_count) == torch.device("cuda", index)


def test_no_visible_gpu():
    assert training_device(3, device_count=0) == torch.device("cpu")
    with pytest.raises(ValueError, match="no visible GPU.*local rank 3"):
        select_device_index(3, 0)
    with pytest.raises(ValueError, match="local rank must be >= 0, got -1"):
        select_device_index(-1, 2)


def test_backend_argument_then_environment_then_default():
    assert resolve_backend(None, env={}, cuda_available=True) == "nccl"
    assert resolve_backend(None, env={}, cuda_available=False) == "gloo"
    assert resolve_backend(None, env={BACKEND_ENV: "gloo"}, cuda_available=True) == "gloo"  # a 1-GPU test host
    assert resolve_backend("GLOO", env={BACKEND_ENV: "nccl"}, cuda_available=True) == "gloo"
    assert resolve_backend("nccl", env={BACKEND_ENV: "gloo"}, cuda_available=True) == "nccl"


def test_nccl_without_cuda_is_refused_naming_where_it_came_from():
    with pytest.raises(ValueError, match=r"'nccl' \(from dist_backend\) needs CUDA"):
        resolve_backend("nccl", env={}, cuda_available=False)
    with pytest.raises(ValueError, match=rf"'nccl' \(from {BACKEND_ENV}\) needs CUDA"):
        resolve_backend(None, env={BACKEND_ENV: "nccl"}, cuda_available=False)


INIT = """
import torch.distributed as dist
import megazero
try:
    megazero.init_distributed(dist_backend="nccl")
except ValueError as e:
    print("refused:", e)
assert not dist.is_initialized()
megazero.init_distributed()
print("backend:", dist.get_backend(), "world:", dist.get_world_size())
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of NCCL on a host without CUDA")
def test_init_distributed_honours_the_argument_and_the_environment():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env[BACKEND_ENV] = "gloo"
    proc = subprocess.run([sys.executable, "-c", INIT], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "refused: backend 'nccl' (from dist_backend) needs CUDA" in proc.stdout
    assert "backend: gloo world: 1" in proc.stdout
