"""count_active_parameters: what the recipes' FLOPs and MFU count for an MoE model."""

from __future__ import annotations

from models.common import count_active_parameters, count_parameters
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig

SHAPE = dict(vocab_size=100, seq_length=16, num_layers=2, hidden_size=32, num_attention_heads=2)


def test_top1_moe_counts_one_expert_plus_its_routers():
    # a top-1 MoE layer's token passes through one expert (exactly a dense MLP) and the router
    for model, config in ((GPT, GPTConfig), (Llama, LlamaConfig)):
        dense = count_parameters(model, config(**SHAPE))
        moe = config(**SHAPE, num_experts=4, moe_router_topk=1)
        assert count_active_parameters(model, moe) == dense + 2 * 4 * 32, model.__name__
        assert count_active_parameters(model, config(**SHAPE)) == dense
        top2 = config(**SHAPE, num_experts=4, moe_router_topk=2)
        assert count_active_parameters(model, top2) - count_active_parameters(model, moe) == \
            (count_parameters(model, top2) - dense - 2 * 4 * 32) // 3  # 4 experts a layer = its MLP + 3 more
