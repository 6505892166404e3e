"""FLOPs profiler counts against hand-computed numbers (within 1%)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from megazero.profiling.flops_profiler import FlopsProfiler, get_model_profile
from models.gpt import Block, GPTConfig


def test_mlp():
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))
    flops, macs, params = get_model_profile(model, input_shape=(3, 10), print_profile=False)
    assert macs == 3 * 10 * 20 + 3 * 20 * 5
    assert flops == 2 * macs + (3 * 20 + 3 * 5) + 3 * 20  # matmuls, biases, relu
    assert params == 10 * 20 + 20 + 20 * 5 + 5


class LeNet5(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 6, 5), nn.Tanh(), nn.AvgPool2d(2),
                                      nn.Conv2d(6, 16, 5), nn.Tanh(), nn.AvgPool2d(2))
        self.classifier = nn.Sequential(nn.Linear(400, 120), nn.Tanh(), nn.Linear(120, 84), nn.Tanh(),
                                        nn.Linear(84, 10))

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def test_lenet5():
    batch = 2
    flops, macs, _ = get_model_profile(LeNet5(), input_shape=(batch, 1, 32, 32), print_profile=False)
    conv_macs = 6 * 28 * 28 * 25 + 16 * 10 * 10 * 6 * 25
    fc_macs = 400 * 120 + 120 * 84 + 84 * 10
    assert macs == pytest.approx(batch * (conv_macs + fc_macs), rel=0.01)
    biases = 6 * 28 * 28 + 16 * 10 * 10 + 120 + 84 + 10
    tanh = 6 * 28 * 28 + 16 * 10 * 10 + 120 + 84
    pools = 6 * 28 * 28 + 16 * 10 * 10
    assert flops == pytest.approx(batch * (2 * (conv_macs + fc_macs) + biases + tanh + pools), rel=0.01)


def test_transformer_layer_and_tree():
    config = GPTConfig(hidden_size=64, num_attention_heads=4, seq_length=16, num_layers=1)
    block = Block(config)
    b, t, d = 2, 16, 64
    profiler = FlopsProfiler(block)
    profiler.start_profile()
    with torch.no_grad():
        block(torch.randn(b, t, d))
    profiler.stop_profile()
    linear_macs = b * t * (d * 3 * d + d * d + d * 4 * d + 4 * d * d)  # 12 B T d^2
    attention_macs = 2 * b * t * t * d  # scores and weighted values over all heads
    assert profiler.get_total_macs() == pytest.approx(linear_macs + attention_macs, rel=0.01)
    expected_flops = (2 * (linear_macs + attention_macs) + b * 4 * t * t  # + softmax over B H T T
                      + b * t * (3 * d + d + 4 * d + d)  # biases
                      + 2 * 5 * b * t * d + b * t * 4 * d)  # two layer norms, gelu
    assert profiler.get_total_flops() == pytest.approx(expected_flops, rel=0.01)
    assert profiler.stats[block.attn].macs == pytest.approx(b * t * 4 * d * d + attention_macs, rel=0.01)
    text = profiler.print_model_profile(module_depth=1, top_modules=2)
    assert "depth 1: top 2 by MACs: mlp" in text and "attn" in text and "backward FLOPs" in text
    assert torch.nn.functional.linear.__name__ == "linear"  # torch restored after stop_profile


def test_engine_profiles_the_configured_step(tmp_path):
    import megazero
    from models.gpt import GPT

    config = GPTConfig(vocab_size=256, seq_length=16, num_layers=2, hidden_size=32, num_attention_heads=4,
                       make_vocab_size_divisible_by=64)
    megazero.set_seed(0)
    model = GPT(config)
    ids = torch.randint(0, 256, (4, 17))
    standalone = FlopsProfiler(model)
    standalone.start_profile()
    with torch.no_grad():
        model(ids[:, :-1], ids[:, 1:])
    standalone.stop_profile()
    out = tmp_path / "flops.txt"
    engine, *_ = megazero.initialize(model=model, config={
        "train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "flops_profiler": {"enabled": True, "profile_step": 2, "module_depth": 1, "output_file": str(out)}})
    for step in range(3):
        engine.backward(engine(ids[:, :-1], ids[:, 1:]))
        engine.step()
        assert out.exists() == (step >= 1), "only step 2's forward is profiled"
    macs = standalone.print_model_profile().split("forward MACs: ")[1].split(" |")[0]
    assert f"forward MACs: {macs}" in out.read_text()
