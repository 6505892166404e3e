"""FLOPs profiler counts against hand-derived counts, asserted exactly (counts are integers, so a
missing bias, activation, pooling, LayerNorm or softmax changes them), and get_model_profile's
arguments with DeepSpeed's meaning and return values."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megazero.profiling.flops_profiler import FlopsProfiler, get_model_profile
from models.gpt import GPT, Block, GPTConfig


def profile(model: nn.Module, *args) -> FlopsProfiler:
    """One counted forward of model(*args), without gradients."""
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    with torch.no_grad():
        model(*args)
    profiler.stop_profile()
    return profiler


def test_mlp_counts_matmuls_biases_and_the_activation():
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))
    flops, macs, params = get_model_profile(model, input_shape=(3, 10), print_profile=False, as_string=False)
    # batch 3: 3 x 10 x 20 + 3 x 20 x 5 = 600 + 300 MACs
    assert macs == 900
    # 2 x 900 (matmuls) + 3 x 20 + 3 x 5 (biases) + 3 x 20 (ReLU) = 1800 + 75 + 60
    assert flops == 1935
    assert params == 10 * 20 + 20 + 20 * 5 + 5 == 325


class LeNet5(nn.Module):
    """LeNet-5: 32x32 -> conv5 (6) -> 28x28 -> pool -> 14x14 -> conv5 (16) -> 10x10 -> pool -> 5x5 -> 400."""

    def __init__(self, pool: type = nn.AvgPool2d):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 6, 5), nn.Tanh(), pool(2), nn.Conv2d(6, 16, 5), nn.Tanh(), pool(2))
        self.classifier = nn.Sequential(nn.Linear(400, 120), nn.Tanh(), nn.Linear(120, 84), nn.Tanh(),
                                        nn.Linear(84, 10))

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


# per image: conv1 6 x 28 x 28 outputs x 25 taps = 117,600; conv2 16 x 10 x 10 x (6 x 25) = 240,000;
# fully connected 400 x 120 + 120 x 84 + 84 x 10 = 48,000 + 10,080 + 840 = 58,920
LENET_MACS = 117_600 + 240_000 + 58_920
# biases (one per output): 4,704 + 1,600 + 120 + 84 + 10; tanh (one per input): 4,704 + 1,600 + 120 + 84;
# pooling (one per input element): 4,704 (6 x 28 x 28) + 1,600 (16 x 10 x 10)
LENET_BIASES, LENET_TANH, LENET_POOLS = 6_518, 6_508, 6_304


def test_lenet5_counts_convolutions_pooling_and_tanh():
    batch = 2
    for pool in (nn.AvgPool2d, nn.MaxPool2d):
        flops, macs, params = get_model_profile(LeNet5(pool), input_shape=(batch, 1, 32, 32), print_profile=False,
                                                as_string=False)
        assert macs == batch * LENET_MACS == 833_040
        assert flops == batch * (2 * LENET_MACS + LENET_BIASES + LENET_TANH + LENET_POOLS) == 1_704_740
        assert params == 61_706  # DeepSpeed's tutorial: LeNet5 has 61.71 k parameters


B, T, D = 2, 16, 64  # batch, tokens, hidden size of the transformer-layer tests (4 heads)
# linears: qkv d x 3d, attention proj d x d, fc d x 4d, mlp proj 4d x d = 12 d^2 per token
LINEAR_MACS = B * T * 12 * D * D  # 1,572,864
ATTENTION_MACS = 2 * B * T * T * D  # scores and weighted values over all heads: 65,536
SOFTMAX = B * 4 * T * T  # one per score, B x heads x T x T: 2,048
BIASES = B * T * (3 * D + D + 4 * D + D)  # 18,432 (the two projections add theirs after F.linear)
LAYER_NORMS = 2 * 5 * B * T * D  # two affine LayerNorms, 5 per element: 20,480
GELU = B * T * 4 * D  # 8,192


def test_transformer_layer_counts_every_term():
    config = GPTConfig(hidden_size=D, num_attention_heads=4, seq_length=T, num_layers=1)
    block = Block(config)
    profiler = profile(block, torch.randn(B, T, D))
    assert profiler.get_total_macs() == LINEAR_MACS + ATTENTION_MACS == 1_638_400
    assert profiler.get_total_flops() == 2 * 1_638_400 + SOFTMAX + BIASES + LAYER_NORMS + GELU == 3_325_952
    assert profiler.stats[block.attn].macs == B * T * 4 * D * D + ATTENTION_MACS
    assert profiler.stats[block.attn].flops == 2 * profiler.stats[block.attn].macs + SOFTMAX + B * T * 4 * D
    assert profiler.stats[block.ln_1].flops == 5 * B * T * D
    assert profiler.stats[block.mlp].flops == 2 * B * T * 8 * D * D + B * T * 5 * D + GELU
    text = profiler.print_model_profile(module_depth=1, top_modules=2, profile_step=3)
    assert text.startswith("profile at step 3 | params: ")
    assert "depth 1: top 2 by MACs: mlp" in text and "attn" in text and "backward FLOPs" in text
    assert F.linear.__name__ == "linear" and F.gelu.__name__ == "gelu"  # torch restored after stop_profile


class ExplicitAttention(nn.Module):
    """Attention written out: q @ k^T, softmax, @ v (what SDPA replaces), with a LayerNorm without affine."""

    def forward(self, q, k, v):
        scores = F.softmax(torch.matmul(q, k.transpose(-1, -2)), dim=-1)
        return F.layer_norm(scores @ v, v.shape[-1:])


def test_softmax_sdpa_and_explicit_attention_count_alike():
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 6)
    explicit = profile(ExplicitAttention(), q, k, v)
    # scores 2 x 3 x 5 x 7 = 210 (x 8 MACs each), weighted values 2 x 3 x 5 x 6 = 180 outputs (x 7 MACs)
    assert explicit.get_total_macs() == 210 * 8 + 180 * 7 == 2_940
    # 2 x MACs + one softmax FLOP per score + 4 per element of the non-affine LayerNorm
    assert explicit.get_total_flops() == 2 * 2_940 + 210 + 4 * 180

    class Fused(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    fused = profile(Fused(), q, k, v)
    assert fused.get_total_macs() == 2_940 and fused.get_total_flops() == 2 * 2_940 + 210


def test_activations_norms_and_pooling_count_one_or_five_per_element():
    x = torch.randn(2, 4, 6, 6)  # 288 elements
    cases = [(nn.GELU(), 288), (nn.SiLU(), 288), (nn.Sigmoid(), 288), (nn.LeakyReLU(), 288), (nn.ELU(), 288),
             (nn.Softmax(dim=1), 288), (nn.MaxPool2d(2), 288), (nn.AdaptiveAvgPool2d(1), 288),
             (nn.LayerNorm([6, 6]), 5 * 288), (nn.LayerNorm([6, 6], elementwise_affine=False), 4 * 288),
             (nn.GroupNorm(2, 4), 5 * 288), (nn.BatchNorm2d(4), 5 * 288), (nn.BatchNorm2d(4).eval(), 2 * 288)]
    for module, flops in cases:
        profiler = profile(module, x)
        assert (profiler.get_total_flops(), profiler.get_total_macs()) == (flops, 0), module


def test_ignore_modules_leaves_their_work_uncounted():
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Sequential(nn.Linear(20, 5), nn.Tanh()))
    flops, macs, _ = get_model_profile(model, input_shape=(3, 10), print_profile=False, as_string=False,
                                       ignore_modules=[nn.ReLU])
    assert (flops, macs) == (2 * 600 + 60 + 2 * 300 + 15 + 15, 900)  # all but ReLU's 60
    flops, macs, params = get_model_profile(model, input_shape=(3, 10), print_profile=False, as_string=False,
                                            ignore_modules=[nn.Sequential])
    assert (flops, macs, params) == (0, 0, 325)  # the root is a Sequential: nothing is profiled


def test_as_string_returns_deepspeeds_strings():
    model = nn.Sequential(nn.Linear(1000, 2000), nn.ReLU())
    flops, macs, params = get_model_profile(model, input_shape=(4, 1000), print_profile=False)  # default: strings
    # MACs 4 x 1000 x 2000 = 8e6; FLOPs 16e6 + 8,000 (bias) + 8,000 (ReLU); params 2,002,000
    assert (flops, macs, params) == ("16.02 M", "8 MMACs", "2 M")
    numbers = get_model_profile(model, input_shape=(4, 1000), print_profile=False, as_string=False)
    assert numbers == (16_016_000, 8_000_000, 2_002_000)


class CountingModel(nn.Module):
    """Linear(4, 3) without bias; records its calls and which keyword it got."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3, bias=False).double()
        self.calls = 0

    def forward(self, x, scale: float = 1.0, *, extra: torch.Tensor | None = None):
        self.calls += 1
        y = self.fc(x) * scale
        return y if extra is None else (y, self.fc(extra))

    def generate(self, x, steps: int):
        for _ in range(steps):
            x = torch.cat([x, self(x[-1:])[:, :1].expand(1, 4)])
        return x


def test_input_shape_args_kwargs_warm_up_and_mode():
    model = CountingModel()
    flops, macs, _ = get_model_profile(model, input_shape=(5, 4), warm_up=3, print_profile=False, as_string=False)
    assert (macs, flops) == (5 * 4 * 3, 2 * 60) and model.calls == 4  # 3 uncounted warm-ups, 1 counted
    assert model.training, "the training mode is restored"
    x = torch.randn(2, 4, dtype=torch.float64)
    _, macs, _ = get_model_profile(model, args=[x, 2.0], kwargs={"extra": torch.randn(7, 4, dtype=torch.float64)},
                                   warm_up=0, print_profile=False, as_string=False)
    assert macs == (2 + 7) * 4 * 3  # the keyword argument reached forward
    _, macs, _ = get_model_profile(model, kwargs={"x": x}, warm_up=0, print_profile=False, as_string=False)
    assert macs == 2 * 4 * 3
    _, macs, _ = get_model_profile(model, args=[x], kwargs={"steps": 3}, mode="generate", print_profile=False,
                                   as_string=False)
    assert macs == 3 * 4 * 3  # generate ran three one-row forwards


def test_generate_mode_on_gpt_counts_the_kv_cached_steps():
    d, vocab, prompt, new = 32, 64, 5, 3
    config = GPTConfig(vocab_size=vocab, seq_length=16, num_layers=1, hidden_size=d, num_attention_heads=2,
                       make_vocab_size_divisible_by=64, dropout=0.1)
    model = GPT(config)
    ids = torch.randint(0, vocab, (1, prompt))
    flops, macs, _ = get_model_profile(model, args=[ids], kwargs={"max_new_tokens": new, "temperature": 0.0},
                                       mode="generate", print_profile=False, as_string=False)
    # the cache: the first step feeds 5 tokens against 5 keys, then 1 token against 6, then 1 against 7
    steps = [(5, 5), (1, 6), (1, 7)]
    expected_macs = sum(n * 12 * d * d + 2 * n * keys * d + n * d * vocab for n, keys in steps)
    per_token = (3 * d + d + 4 * d + d) + 2 * 5 * d + 4 * d + 5 * d  # biases, two LayerNorms, GeLU, ln_f
    expected_flops = sum(2 * n * 12 * d * d + 4 * n * keys * d + 2 * n * d * vocab + 2 * n * keys + n * per_token
                         for n, keys in steps)  # + the softmax over 2 heads x n x keys scores
    assert (macs, flops) == (expected_macs, expected_flops)
    assert model.training


def test_print_profile_detailed_depth_and_output_file(tmp_path, capsys):
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Sequential(nn.Linear(20, 5), nn.Tanh()))
    get_model_profile(model, input_shape=(3, 10))
    printed = capsys.readouterr().out
    assert "forward MACs: 900 MACs" in printed and "  2.0 (Linear)" in printed
    get_model_profile(model, input_shape=(3, 10), detailed=False, module_depth=1, top_modules=2)
    printed = capsys.readouterr().out
    assert "depth 1: top 2 by MACs: 0 600 MACs, 2 300 MACs" in printed
    assert "depth 2" not in printed and "(Linear)" not in printed
    out = tmp_path / "profile.txt"
    get_model_profile(model, input_shape=(3, 10), output_file=str(out))
    assert capsys.readouterr().out == "" and "forward FLOPs: 1.95 K" in out.read_text()
    get_model_profile(model, input_shape=(3, 10), print_profile=False)
    assert capsys.readouterr().out == ""


def test_bad_arguments_name_the_argument():
    model = nn.Linear(2, 2)
    for kwargs, message in [({"input_shape": [3, 2]}, "input_shape must be a non-empty tuple"),
                            ({}, "give input_shape, or args"),
                            ({"input_shape": (3, 2), "mode": "backward"}, "mode must be 'forward' or 'generate'"),
                            ({"input_shape": (3, 2), "mode": "generate"}, "needs model.generate"),
                            ({"input_shape": (3, 2), "ignore_modules": ["Linear"]}, "expected module types")]:
        with pytest.raises((TypeError, ValueError), match=message):
            get_model_profile(model, print_profile=False, **kwargs)


def test_engine_profiles_the_configured_step(tmp_path):
    import megazero

    config = GPTConfig(vocab_size=256, seq_length=16, num_layers=2, hidden_size=32, num_attention_heads=4,
                       make_vocab_size_divisible_by=64)
    megazero.set_seed(0)
    model = GPT(config)
    ids = torch.randint(0, 256, (4, 17))
    standalone = profile(model, ids[:, :-1], ids[:, 1:])
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


def test_module_timers_synchronise_exactly_the_cuda_devices():
    """CUDA runs asynchronously: a module's latency is read after synchronising its devices (else it
    measures kernel launches); a CPU model needs no synchronisation."""
    from megazero.profiling.flops_profiler import device_synchronizer

    assert device_synchronizer([torch.device("cpu")]) is None
    assert device_synchronizer([]) is None
    assert callable(device_synchronizer([torch.device("cpu"), "cuda:1", torch.device("cuda", 0)]))
    profiler = FlopsProfiler(torch.nn.Linear(4, 4))
    profiler.start_profile()
    assert profiler._synchronize is None
    profiler.end_profile()
