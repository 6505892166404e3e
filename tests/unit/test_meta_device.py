"""megazero.meta_device.skeleton: the meta build draws no random numbers and imports no torch._dynamo."""

from __future__ import annotations

import subprocess
import sys

import torch

from megazero.meta_device import skeleton
from models.gpt import GPT, GPTConfig


def test_skeleton_has_the_model_shapes_and_leaves_the_generator_alone():
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=100, seq_length=16)
    state = torch.random.get_rng_state()
    with skeleton():
        meta = GPT(config)
    assert torch.equal(state, torch.random.get_rng_state())
    real = GPT(config)
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [(n, p.shape) for n, p in real.named_parameters()]
    assert all(p.is_meta for p in meta.parameters())
    with skeleton():  # a fill of a tensor that is not on the meta device still runs
        cpu = torch.zeros(4, device="cpu")
        torch.nn.init.normal_(cpu)
    assert cpu.abs().sum() > 0


def test_counting_parameters_does_not_import_dynamo():
    # torch's meta normal_ imports torch._dynamo and sympy on first use: ~2 CPU-s in every tool that counts
    code = ("import sys; from models.common import count_parameters; from models.gpt import GPT, GPTConfig; "
            "n = count_parameters(GPT, GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=100,"
            " seq_length=16)); print(n, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["30080", "False"], out
