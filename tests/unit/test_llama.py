"""The Llama in one process: the KV cache holds only the key/value heads (GQA-sized) and changes
nothing (greedy output identical with and without it, also past seq_length), recomputation
(full and selective) is bit-exact with dropout on, the stages and the tied option answer the
model contract, and a config that cannot be built is refused saying why."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megazero.tensor_parallel import model_parallel_seed
from models.common import count_parameters
from models.llama import Llama, LlamaConfig
from models.parallelize import build_stage, config_class_for, parallelize

SMALL = dict(vocab_size=200, seq_length=24, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
             make_vocab_size_divisible_by=64)


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(**SMALL)).eval()


@pytest.mark.parametrize("new_tokens", [5, 30])  # 30: past seq_length, the window slides
def test_greedy_identical_with_and_without_cache(model, new_tokens):
    prompt = torch.randint(0, 200, (2, 6), generator=torch.Generator().manual_seed(1))
    cached = model.generate(prompt, new_tokens, temperature=0, use_kv_cache=True)
    assert torch.equal(cached, model.generate(prompt, new_tokens, temperature=0, use_kv_cache=False))
    assert cached.shape == (2, 6 + new_tokens) and int(cached.max()) < 200


def test_cache_is_gqa_sized_and_cached_logits_equal_full_forward(model):
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = [{} for _ in model.blocks]
    with torch.no_grad():
        first = model(ids[:, :8], kv_cache=cache)
        rest = model(ids[:, 8:], kv_cache=cache)  # several new tokens at once: the offset causal mask
        full = model(ids)
    assert cache[0]["k"].shape == cache[0]["v"].shape == (1, 2, 12, 8)  # 2 groups, not 4 heads
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_is_bit_exact_with_dropout(granularity):
    config = LlamaConfig(**SMALL, dropout=0.1)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(3))
    runs = []
    for recompute in (None, granularity):
        torch.manual_seed(0)
        model = parallelize(dataclasses.replace(config, recompute_granularity=recompute))
        model_parallel_seed(5, 0)  # the dropout masks: default generator and tracker
        loss = model(ids, labels=ids)
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(g, runs[1][1][n]) for n, g in runs[0][1].items())


@pytest.mark.parametrize("untied", [True, False])
def test_stages_and_tied_option_answer_the_contract(untied):
    config = LlamaConfig(**SMALL, untie_embeddings_and_output_weights=untied)
    whole = Llama(config)
    assert ("lm_head.weight" in dict(whole.named_parameters())) == untied
    stages = [build_stage(config, s, 2) for s in range(2)]
    names = {stage.global_parameter_name(n) for stage in stages for n, _ in stage.named_parameters()}
    assert names == {n for n, _ in whole.named_parameters()}
    assert [len(stage.tied_parameters()) for stage in stages] == ([0, 0] if untied else [1, 1])
    assert whole.total_parameters() == count_parameters(Llama, config) == sum(p.numel() for p in whole.parameters())
    assert config_class_for(config.to_dict()) is LlamaConfig


@pytest.mark.parametrize("changes,message", [
    ({"num_query_groups": 3}, "num_attention_heads 4 is not divisible by num_query_groups 3"),
    ({"hidden_size": 36}, "head size 9 must be even for rotary"),
    ({"tensor_model_parallel_size": 8}, "num_attention_heads 4 is not divisible by tensor_model_parallel_size 8"),
])
def test_config_refuses_what_cannot_be_built(changes, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**{**SMALL, **changes})
