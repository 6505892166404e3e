"""Generation: the KV cache changes nothing (greedy output identical with and without it, also past
seq_length where the window slides), and top-k / top-p keep only the tokens they should."""

from __future__ import annotations

import pytest
import torch

from models.gpt import GPT, GPTConfig

SMALL = dict(vocab_size=200, seq_length=24, num_layers=2, hidden_size=32, num_attention_heads=4,
             make_vocab_size_divisible_by=64)


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**SMALL)).eval()


@pytest.mark.parametrize("new_tokens", [5, 40])  # 40: past seq_length, the window slides
def test_greedy_identical_with_and_without_cache(model, new_tokens):
    prompt = torch.randint(0, 200, (2, 6), generator=torch.Generator().manual_seed(1))
    cached = model.generate(prompt, new_tokens, temperature=0, use_kv_cache=True)
    plain = model.generate(prompt, new_tokens, temperature=0, use_kv_cache=False)
    assert torch.equal(cached, plain)
    assert cached.shape == (2, 6 + new_tokens) and int(cached.max()) < 200  # padding ids never produced


def test_cached_logits_equal_full_forward(model):
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = [{} for _ in model.blocks]
    with torch.no_grad():
        first = model(ids[:, :8], kv_cache=cache)
        rest = model(ids[:, 8:], kv_cache=cache)  # several new tokens at once: the offset causal mask
        full = model(ids)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, rtol=1e-5, atol=1e-5)


def test_sampling_is_seeded_and_filtered(model):
    prompt = torch.randint(0, 200, (1, 4), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(7)
    a = model.generate(prompt, 10, temperature=0.8, top_k=5, top_p=0.9)
    torch.manual_seed(7)
    b = model.generate(prompt, 10, temperature=0.8, top_k=5, top_p=0.9)
    assert torch.equal(a, b)
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]])
    for _ in range(20):  # top_p 0.5: only the most likely token (probability 0.71) survives
        assert GPT._next_token(logits, 1.0, None, 0.5).item() == 0
        assert GPT._next_token(logits, 1.0, 2, None).item() in (0, 1)
