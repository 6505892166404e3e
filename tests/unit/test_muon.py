"""Muon against a plain-torch transcription of the reference (Keller Jordan's Muon as published:
its blog post and muon.py), written out here op by op; the parameter-group rule; the options."""

from __future__ import annotations

import pytest
import torch

import megazero
from megazero.config import ConfigError
from megazero.optim import muon as muon_module
from megazero.optim.muon import Muon, MuonParams, is_muon_matrix, muon_param_groups, newton_schulz
from megazero.tensor_parallel.utils import set_tensor_parallel_attributes
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig


def _reference_zeropower(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The reference's zeropower_via_newtonschulz5: quintic coefficients, wide orientation,
    Frobenius normalisation, X = aX + (bA + cA @ A) X with A = X X^T."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.to(dtype)
    if g.size(0) > g.size(1):
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        poly = b * gram + c * gram @ gram
        x = a * x + poly @ x
    if g.size(0) > g.size(1):
        x = x.T
    return x


def _reference_muon(w: torch.Tensor, grads: list[torch.Tensor], lr: float, beta: float, wd: float,
                    nesterov: bool, dtype: torch.dtype) -> torch.Tensor:
    """The reference's update: momentum.lerp_(g, 1 - beta); U = g.lerp(momentum, beta) (Nesterov)
    or the momentum; U = zeropower(U) * max(1, rows/cols)**0.5; w *= 1 - lr*wd; w -= lr*U."""
    w, m = w.clone(), torch.zeros_like(w)
    for g in grads:
        m = m + (1 - beta) * (g - m)
        u = g + beta * (m - g) if nesterov else m
        u = _reference_zeropower(u, 5, dtype).float() * max(1, w.size(0) / w.size(1)) ** 0.5
        w = w * (1 - lr * wd) - lr * u
    return w


def _muon_run(w: torch.Tensor, grads: list[torch.Tensor], **options) -> torch.Tensor:
    p = torch.nn.Parameter(w.clone())
    opt = Muon([{"params": [p], "use_muon": True}], **options)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("shape", [(48, 32), (32, 80)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_follows_the_reference(shape, nesterov):
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.1
    grads = [torch.randn(shape) * (1 + step) for step in range(6)]
    options = dict(lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=nesterov)
    # fp32 matmuls: the same arithmetic up to fp32 rounding
    expected = _reference_muon(w, grads, 0.02, 0.95, 0.1, nesterov, torch.float32)
    torch.testing.assert_close(_muon_run(w, grads, ns_dtype="float32", **options), expected, rtol=0, atol=1e-6)
    # bf16 (the reference's and the default): megazero fuses bA + cA@A into one addmm, rounding once
    # where the reference rounds twice: not bit for bit, but at least as close to the fp32 result
    # as the reference's own bf16 run (about 2% of the update over 6 steps)
    reference_bf16 = _reference_muon(w, grads, 0.02, 0.95, 0.1, nesterov, torch.bfloat16)
    got = _muon_run(w, grads, **options)
    size = float((expected - w).norm())
    assert float((got - expected).norm()) <= float((reference_bf16 - expected).norm()) < 0.04 * size
    assert float((got - reference_bf16).norm()) < 0.04 * size


def test_newton_schulz_approximately_orthogonalises():
    torch.manual_seed(1)
    g = torch.randn(64, 24) @ torch.diag(torch.logspace(-1, 1, 24))  # singular values over 2 decades
    s = torch.linalg.svdvals(newton_schulz(g, 5, torch.float32))
    assert float(s.min()) > 0.6 and float(s.max()) < 1.25, s  # the quintic's band, not 1 exactly
    assert float(torch.linalg.svdvals(g).max() / torch.linalg.svdvals(g).min()) > 30


def test_fused_weight_is_orthogonalised_per_logical_matrix():
    """A [Q; K; V] weight (partition_stride 3) steps as three separate weights would."""
    torch.manual_seed(2)
    blocks = [torch.randn(16, 24) for _ in range(3)]
    grads = [[torch.randn(16, 24) for _ in range(3)] for _ in range(3)]
    p = torch.nn.Parameter(torch.cat(blocks))
    set_tensor_parallel_attributes(p, 0, 3)
    opt = Muon([{"params": [p], "use_muon": True}], lr=0.05, ns_dtype="float32")
    for step in grads:
        p.grad = torch.cat(step)
        opt.step()
    separate = [_muon_run(b, [step[i] for step in grads], lr=0.05, ns_dtype="float32") for i, b in enumerate(blocks)]
    torch.testing.assert_close(p.detach(), torch.cat(separate), rtol=0, atol=1e-6)
    whole = _muon_run(torch.cat(blocks), [torch.cat(step) for step in grads], lr=0.05, ns_dtype="float32")
    assert float((whole - p.detach()).abs().max()) > 1e-3  # orthogonalising the stack is another update


def test_spectral_scale_matches_adamw_rms():
    """Moonlight's 0.2 * sqrt(max(rows, cols)) gives updates of RMS about 0.2, as AdamW's."""
    torch.manual_seed(3)
    w = torch.zeros(96, 32)
    update = -_muon_run(w, [torch.randn(96, 32)], lr=1.0, scale_mode="spectral", extra_scale_factor=0.2)
    assert 0.15 < float(update.pow(2).mean().sqrt()) < 0.25


def test_adamw_part_follows_adamw():
    torch.manual_seed(4)
    w, grads = torch.randn(10), [torch.randn(10) for _ in range(4)]
    p, q = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    ours = Muon([{"params": [p], "use_muon": False}], adamw_lr=1e-2, adamw_betas=(0.9, 0.95), adamw_eps=1e-8,
                adamw_weight_decay=0.1)
    torchs = torch.optim.AdamW([q], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for g in grads:
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        torchs.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)


def test_param_group_rule():
    gpt = GPT(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8))
    groups = muon_param_groups(gpt, [{"params": list(gpt.parameters()), "weight_decay": 0.1}])
    names = {id(p): n for n, p in gpt.named_parameters()}
    muon = sorted(names[id(p)] for g in groups if g["use_muon"] for p in g["params"])
    assert muon == ["blocks.0.attn.proj.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight",
                    "blocks.0.mlp.proj.weight"]
    assert all(g["weight_decay"] == 0.1 for g in groups)  # the group's own options kept
    llama = Llama(LlamaConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                              ffn_hidden_size=64, vocab_size=64, seq_length=8,
                              untie_embeddings_and_output_weights=True))
    lm_head = llama.lm_head.weight
    assert lm_head.dim() == 2 and not is_muon_matrix("lm_head.weight", lm_head)
    assert is_muon_matrix("lm_head.weight", lm_head, adamw_params=["*wte*"])  # the user's own rule
    moe = GPT(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8,
                        num_experts=2))
    stacks = [n for n, p in moe.named_parameters() if p.dim() == 3 and is_muon_matrix(n, p)]
    assert stacks == ["blocks.0.mlp.experts.fc1_weight", "blocks.0.mlp.experts.fc2_weight"], stacks


def test_expert_stack_is_orthogonalised_expert_by_expert():
    torch.manual_seed(5)
    experts = [torch.randn(12, 20) for _ in range(3)]
    stack = muon_module.orthogonalize(torch.stack(experts), {"ns_dtype": "float32", "ns_steps": 5,
                                                             "scale_mode": "shape", "extra_scale_factor": 1.0})
    for got, matrix in zip(stack, experts):
        torch.testing.assert_close(got, newton_schulz(matrix, 5, torch.float32), rtol=0, atol=1e-6)


def test_options_are_checked():
    with pytest.raises(ValueError, match="scale_mode"):
        MuonParams(scale_mode="rms")
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="use_muon"):
        Muon([p])


def test_muon_refuses_optimizer_offload_to_nvme(tmp_path):
    model = GPT(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8))
    zero = {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    config = {"train_batch_size": 2, "optimizer": {"type": "Muon", "params": {}}, "zero_optimization": zero}
    with pytest.raises(ConfigError, match="Muon with zero_optimization.offload_optimizer"):
        megazero.initialize(model=model, config=config)


def test_default_orthogonalizer_is_whole_tensors():
    assert muon_module.Muon([{"params": [torch.nn.Parameter(torch.zeros(2, 2))], "use_muon": True}]).orthogonalizer \
        is muon_module.whole_tensor_orthogonalizer
