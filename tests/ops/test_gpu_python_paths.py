"""What only a GPU proves of issue 15's Python-side fixes (CPU tests cover their logic): NCCL
init on the device local_rank % GPUs, zero.Init partitions on the GPU, gradient norms with no host
sync before the step's one read, the RNG tracker seeded before CUDA forking the GPU's generator,
the flops profiler timing kernels rather than launches, the peak measured on the GPU, and (with 2
GPUs) the pipeline exchange over NCCL with activations beyond NCCL's buffering. Skipped without a
GPU; each NCCL or fresh-CUDA check runs in its own process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import REPO, repo_pythonpath

pytestmark = pytest.mark.cuda

if torch.version.cuda is None or not torch.cuda.is_available():
    pytest.skip("needs a GPU and a CUDA build of torch (this is a CPU run)", allow_module_level=True)



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(script: str, env: dict[str, str], timeout: float = 240) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                          env={**base, "PYTHONPATH": repo_pythonpath(), **env}, timeout=timeout)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc.stdout


NCCL_WORLD_ONE = r"""
import torch, torch.distributed as dist, megazero
from megazero.distributed import all_reduce_sum
from megazero.zero import Init
from megazero.zero.master_partitions import SquaredNormSum
from models.gpt import GPTConfig
from models.parallelize import parallelize
from tests.training_helpers import TINY, base_config

launch = megazero.init_distributed()  # LOCAL_RANK = the number of GPUs: an invalid ordinal before issue 15
assert dist.get_backend() == "nccl", dist.get_backend()
assert torch.cuda.current_device() == launch.local_rank % torch.cuda.device_count()
print("device", torch.cuda.current_device())

views = [torch.randn(1 << 20, device="cuda")[i::3] for i in range(3)]
total = SquaredNormSum()
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")  # any host sync below raises
total.add(views[:2]); total.add(views[2:])
summed = all_reduce_sum(total.total())
torch.cuda.set_sync_debug_mode("default")
expected = sum(float(v.double().norm()) ** 2 for v in views)
assert abs(summed.item() - expected) <= 1e-5 * expected, (summed.item(), expected)
print("norm without sync ok")

STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
def losses(model):
    engine, *_ = megazero.initialize(model=model, config=base_config(zero_optimization=STAGE3))
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(3):
        ids = torch.randint(0, TINY["vocab_size"], (8, TINY["seq_length"] + 1), generator=g)
        out.append(engine.train_batch(iter([{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}])).item())
    return out

megazero.set_seed(0)
with Init() as init:
    model = parallelize(GPTConfig(**TINY))  # built on the CPU: partitioned straight onto the GPU
assert init.device == torch.device("cuda", torch.cuda.current_device()), init.device
assert all(p.device.type == "cuda" and p._megazero_init_chunk.device.type == "cuda" for p in model.parameters())
with_init = losses(model)
megazero.set_seed(0)
plain = losses(parallelize(GPTConfig(**TINY)).cuda())  # fused kernels, as the recipes build it
assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(with_init, plain)), (with_init, plain)
print("zero.Init on the GPU trains like the plain model", with_init)
"""


def test_nccl_world_one_device_choice_init_placement_and_sync_free_norms():
    out = _run(NCCL_WORLD_ONE, {"MEGAZERO_DIST_BACKEND": "nccl", "RANK": "0", "WORLD_SIZE": "1",
                                "LOCAL_RANK": str(torch.cuda.device_count()), "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": str(_free_port())})
    assert "device 0" in out and "norm without sync ok" in out and "zero.Init on the GPU" in out


TRACKER_BEFORE_CUDA = r"""
import torch
from megazero.tensor_parallel.random import RNGStatesTracker, get_rng_tracker, seed_tracker

seed_tracker(1234, 0)  # before CUDA is initialised (as initialize() may run before model.cuda())
assert not torch.cuda.is_initialized()
other = RNGStatesTracker(); other.add("model-parallel-rng", 1234 + 2718 + 1)  # TP rank 1's state
x = torch.ones(4096, device="cuda")
torch.cuda.manual_seed(5)
before = torch.cuda.get_rng_state()
with get_rng_tracker().fork():
    mask0 = torch.nn.functional.dropout(x, 0.5) != 0
with other.fork():
    mask1 = torch.nn.functional.dropout(x, 0.5) != 0
assert torch.equal(torch.cuda.get_rng_state(), before), "the default CUDA generator was left as it was"
assert not torch.equal(mask0, mask1), "TP ranks draw different attention-dropout masks on the GPU"
torch.cuda.manual_seed(1234 + 2718)
assert torch.equal(mask0, torch.nn.functional.dropout(x, 0.5) != 0), "rank 0 draws its seed's CUDA stream"
print("tracker ok")
"""


def test_rng_tracker_seeded_before_cuda_forks_the_gpus_generator():
    assert "tracker ok" in _run(TRACKER_BEFORE_CUDA, {})


def test_flops_profiler_times_kernels_not_launches():
    from megazero.profiling.flops_profiler import FlopsProfiler

    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
    x = torch.randn(8192, 4096, device="cuda")
    with torch.no_grad():
        model(x)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(x)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        profiler = FlopsProfiler(model)
        profiler.start_profile()
        model(x)
        profiler.stop_profile()
    assert profiler.get_total_duration() >= 0.7 * wall, (profiler.get_total_duration(), wall)


def test_peak_is_measured_on_the_gpu_in_the_training_dtype(tmp_path):
    from megazero.profiling.throughput import machine_key, measure_peak_flops

    path = str(tmp_path / "peak.json")
    bf16 = measure_peak_flops(torch.bfloat16, seconds=0.2, device="cuda", cache_path=path)
    fp32 = measure_peak_flops(torch.float32, seconds=0.2, device="cuda", cache_path=path)
    key = machine_key(torch.device("cuda", torch.cuda.current_device()), torch.float32, 8192)
    assert key.startswith(f"cuda {torch.cuda.get_device_name()}") and "tf32=" in key
    assert bf16 > 1.5 * fp32 or torch.backends.cuda.matmul.allow_tf32, (bf16, fp32)
    print(f"peak bf16 {bf16 / 1e12:.0f} TFLOP/s, fp32 {fp32 / 1e12:.0f} TFLOP/s")


PIPELINE_TWO_GPUS = r"""
import os, sys, datetime
import torch, torch.distributed as dist, torch.multiprocessing as mp

def rank_main(rank, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), MEGAZERO_DIST_BACKEND="nccl")
    import megazero
    from megazero.pipeline import StageLinks, one_f_one_b
    megazero.init_distributed(timeout=120)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4096, 4096, device="cuda") for _ in range(2)]
    inputs = [torch.randn(2048, 4096, device="cuda") for _ in range(6)]  # 32 MiB per message
    links = StageLinks([0, 1], rank, dist.group.WORLD, torch.float32, torch.device("cuda", rank))
    def forward_step(m, received):
        y = torch.tanh(layers[rank](inputs[m] if received is None else received))
        return y.pow(2).mean() if rank == 1 else y
    def backward_step(m, output, output_grad):
        torch.autograd.backward(output, output_grad)
    one_f_one_b(6, rank, 2, links, forward_step, backward_step)
    torch.cuda.synchronize()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank_main, args=(int(sys.argv[1]),), nprocs=2, join=True)
    print("pipeline over NCCL ok")
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between two ranks needs two GPUs")
def test_one_f_one_b_over_nccl_with_activations_beyond_its_buffers(tmp_path):
    script = tmp_path / "pipeline_two_gpus.py"
    script.write_text(PIPELINE_TWO_GPUS)
    proc = subprocess.run([sys.executable, str(script), str(_free_port())], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": repo_pythonpath()}, timeout=240)
    assert proc.returncode == 0 and "pipeline over NCCL ok" in proc.stdout, proc.stderr[-4000:]
