"""Split backward (megazero.tensor_parallel.weight_grad): B then W equals the fused backward bit for
bit, equals F.linear's autograd, and W reaches the parameters through autograd (their hooks fire);
the GPT and the Llama defer every linear layer's W, the tied output layer's included; the peak
activation meter counts what a pending W keeps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.tensor_parallel.weight_grad import STORE, deferring, linear, splittable


def _two_layers(bias: bool):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32, bias=bias), torch.nn.Linear(32, 8, bias=bias)]
    x = torch.randn(4, 5, 16, requires_grad=True)
    return layers, x


def _run(mode: str, bias: bool):
    """Gradients of x and of every parameter: F.linear's autograd ("torch"), the splittable linear
    in one backward ("fused"), or its B under deferring() then W ("split")."""
    layers, x = _two_layers(bias)
    fired = []
    for layer in layers:
        for p in layer.parameters():
            p.register_post_accumulate_grad_hook(lambda p: fired.append(p.shape))
    fn = F.linear if mode == "torch" else linear
    with splittable(mode != "torch"):
        y = fn(torch.tanh(fn(x, layers[0].weight, layers[0].bias)), layers[1].weight, layers[1].bias)
    loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()
    if mode == "split":
        with deferring("m0"):
            loss.backward()
        assert x.grad is not None and all(p.grad is None for layer in layers for p in layer.parameters())
        assert fired == [] and STORE.run("m0") == 2 and STORE.pending == {}
    else:
        loss.backward()
    assert len(fired) == (4 if bias else 2)
    return [x.grad] + [p.grad for layer in layers for p in layer.parameters()]


@pytest.mark.parametrize("bias", [True, False])
def test_b_then_w_equals_the_fused_backward_and_torch(bias):
    fused, split, torch_grads = _run("fused", bias), _run("split", bias), _run("torch", bias)
    for a, b in zip(fused, split, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(fused, torch_grads, strict=True):
        assert torch.equal(a, b)


def test_outside_splittable_linear_is_f_linear_and_a_non_leaf_weight_computes_w_with_b():
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(2, 3)
    assert linear(x, w).grad_fn.name() == F.linear(x, w).grad_fn.name()
    with splittable():
        y = linear(x, w * 2)  # a weight reached through another function: no deferral
    with deferring("m"):
        y.sum().backward()
    assert w.grad is not None and STORE.pending == {}


def test_peak_activation_meter_counts_saved_tensors_and_pending_w_inputs():
    """PeakActivationMeter (bench_parallel's memory column): the saved tensors live until their
    backward, a deferred W keeps its layer's input and output gradient until it runs."""
    from megazero.profiling.memory import ActivationMeter, PeakActivationMeter

    layer = torch.nn.Linear(256, 256, bias=False)
    x = torch.randn(64, 256, requires_grad=True)  # 64 KiB, as each activation here
    kib = 2 ** 10
    with PeakActivationMeter(exclude=layer.parameters()) as meter:
        with ActivationMeter(), splittable():
            hidden = torch.relu(linear(x, layer.weight))  # saves x, then relu's output
            y = linear(hidden, layer.weight)  # saves relu's output again: one storage
        assert meter.live == 2 * 64 * kib
        with deferring("w"):
            y.backward(torch.ones_like(y))
        # autograd dropped its saved tensors; the two pending W's keep x, the relu output and the
        # two layers' output gradients
        assert meter.live == 4 * 64 * kib
        STORE.run("w")
        assert meter.live == 0 and meter.peak == 4 * 64 * kib


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_models_defer_every_linear_weight_gradient_the_tied_output_layer_included(family):
    """In a zero-bubble schedule's B, the GPT's (and the tied Llama's) attention, MLP and output layer
    file their W; the tied embedding's gradient then holds the lookup's part alone until the W runs,
    and B then W equals the fused backward."""
    from models.gpt import GPT, GPTConfig
    from models.llama import Llama, LlamaConfig

    shape = dict(vocab_size=64, seq_length=8, num_layers=2, hidden_size=32, num_attention_heads=4, dropout=0.1)
    model_class, config = (GPT, GPTConfig(**shape)) if family == "gpt" else \
        (Llama, LlamaConfig(**shape, untie_embeddings_and_output_weights=False, fused_kernels=False))
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    grads = {}
    for mode in ("fused", "split"):
        torch.manual_seed(0)
        model = model_class(config)
        with splittable():
            loss = model(ids[:, :-1], labels=ids[:, 1:])
        if mode == "split":
            with deferring("k"):
                loss.backward()
            # per layer: qkv, attention out, MLP in and out (the Llama's SwiGLU: gate, up, down)
            linears = 4 if family == "gpt" else 5
            assert len(STORE.pending["k"]) == linears * config.num_layers + 1  # + the output layer
            lookup_only = model.wte.weight.grad.clone()
            assert STORE.run("k") == linears * config.num_layers + 1
            assert not torch.equal(lookup_only, model.wte.weight.grad)  # the output layer's part came with W
        else:
            loss.backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads["fused"].items():
        torch.testing.assert_close(grads["split"][name], grad, rtol=0, atol=1e-6, msg=name)
