"""Activation checkpointing: gradients equal those without it, bit for bit (fp32, dropout on)."""

from __future__ import annotations

import pytest
import torch

import megazero.activation_checkpointing as ac
from models.gpt import GPT, GPTConfig

SMALL = dict(vocab_size=256, seq_length=16, num_layers=3, hidden_size=32, num_attention_heads=4,
             make_vocab_size_divisible_by=64, dropout=0.1)


def _grads(recompute: str | None, layers: int | None = None, cpu: bool = False) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, recompute_granularity=recompute, recompute_num_layers=layers))
    ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    ac.configure(cpu_checkpointing=cpu)
    try:
        torch.manual_seed(2)  # the dropout masks
        model(ids[:, :-1], ids[:, 1:]).backward()
    finally:
        ac.configure()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("recompute, layers, cpu", [("full", None, False), ("full", 2, False),
                                                    ("selective", None, False), ("full", None, True)])
def test_gradients_bit_for_bit(recompute, layers, cpu):
    reference = _grads(None)
    other = _grads(recompute, layers, cpu)
    for name, grad in reference.items():
        assert torch.equal(grad, other[name]), name


def test_dropout_is_really_on():
    """The bit-equality above is meaningful: other dropout masks give other gradients."""
    reference = _grads(None)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(3)
    model(ids[:, :-1], ids[:, 1:]).backward()
    assert not all(torch.equal(reference[n], p.grad) for n, p in model.named_parameters())




def test_deepspeed_module_name():
    import megazero.checkpointing

    assert megazero.checkpointing.checkpoint is ac.checkpoint
    assert megazero.checkpointing.configure is ac.configure
