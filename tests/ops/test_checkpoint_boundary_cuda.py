"""synchronize_checkpoint_boundary on a GPU: torch's profiler sees one cudaDeviceSynchronize per
checkpoint boundary (4 per checkpointed layer: both ends of its forward and of its
recompute-and-backward). Skipped with a reason where there is no GPU."""

from __future__ import annotations

import pytest
import torch

import megazero.activation_checkpointing as ac
from models.gpt import GPTConfig
from models.parallelize import parallelize

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a GPU and a CUDA build of torch (this is a CPU run)", allow_module_level=True)

LAYERS = 3


def _device_synchronizations(synchronize: bool) -> int:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, seq_length=16, num_layers=LAYERS, hidden_size=32, num_attention_heads=4,
                       make_vocab_size_divisible_by=64, dropout=0.1, recompute_granularity="full")
    model = parallelize(config).cuda()
    ids = torch.randint(0, 256, (4, 17), device="cuda")
    ac.configure(synchronize_checkpoint_boundary=synchronize)
    try:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            model(ids[:, :-1], ids[:, 1:]).backward()
    finally:
        ac.configure()
    return sum(1 for e in prof.events() if e.name == "cudaDeviceSynchronize")


def test_one_device_synchronize_per_boundary():
    assert _device_synchronizations(True) - _device_synchronizations(False) == 4 * LAYERS
