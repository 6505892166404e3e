"""The MoE layer in one process: the router (deterministic, ties to the lower expert, top-1/top-2,
both score orders), the auxiliary losses against a hand computation, token dropping by global
order (an EP rank's decision from the all-gathered counts equals the single process's on the
concatenated batch), dropless mode, and the grouped experts against a per-token loop."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megazero.moe import MoEConfig, MoELayer, Router, moe_aux_loss, moe_stats, plan_dispatch
from megazero.moe.capacity import expert_capacity


def _identity_router(topk: int, score_order: str = "softmax_topk") -> Router:
    router = Router(4, 4, topk, score_order)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))  # logits = x
    return router


def test_router_is_deterministic_and_breaks_ties_to_the_lower_expert():
    torch.manual_seed(0)
    router = Router(16, 4, 2)
    x = torch.randn(20, 16)
    first, second = router(x), router(x.clone())
    assert torch.equal(first.experts, second.experts) and torch.equal(first.weights, second.weights)
    tied = _identity_router(2)(torch.tensor([[1.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0]]))
    assert tied.experts.tolist() == [[1, 2], [0, 1]]


@pytest.mark.parametrize("topk", [1, 2])
def test_router_topk_and_score_order(topk):
    x = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])
    pre = _identity_router(topk, "softmax_topk")(x)
    post = _identity_router(topk, "topk_softmax")(x)
    expected = [[1, 2], [0, 3]]
    assert pre.experts.tolist() == post.experts.tolist() == [row[:topk] for row in expected]
    probs = x.softmax(-1)
    torch.testing.assert_close(pre.weights, probs.gather(1, pre.experts))  # not renormalised
    torch.testing.assert_close(post.weights, x.gather(1, post.experts).softmax(-1))  # sums to one
    torch.testing.assert_close(post.weights.sum(-1), torch.ones(2))
    assert pre.weights.dtype == torch.float32 and pre.logits.dtype == torch.float32
    with pytest.raises(ValueError, match="topk must be 1 or 2, got 3"):
        Router(4, 4, 3)


def test_aux_and_z_loss_match_a_hand_computation():
    x = [[2.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.5, 0.0], [1.5, 0.0, 0.0, 1.0]]
    layer = MoELayer(MoEConfig(4, 8, 4, router_topk=1, aux_loss_coeff=0.1, z_loss_coeff=0.01))
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4))
    layer(torch.tensor(x))
    softmax = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in x]
    chosen = [row.index(max(row)) for row in x]  # experts 0, 1, 0
    f = [chosen.count(e) / 3 for e in range(4)]
    p = [sum(s[e] for s in softmax) / 3 for e in range(4)]
    aux = 4 * sum(fe * pe for fe, pe in zip(f, p))
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in x) / 3
    assert layer.last_aux_losses["load_balancing"].item() == pytest.approx(0.1 * aux, rel=1e-6)
    assert layer.last_aux_losses["z_loss"].item() == pytest.approx(0.01 * z, rel=1e-6)
    assert moe_aux_loss(torch.nn.Sequential(layer)).item() == pytest.approx(0.1 * aux + 0.01 * z, rel=1e-6)
    assert layer.last_stats["tokens_per_expert_min"].item() == 0
    assert layer.last_stats["tokens_per_expert_max"].item() == 2


def _kept_global(experts_per_rank: list[torch.Tensor], factor: float | None) -> set[tuple[int, int]]:
    """(global token, expert) pairs kept when each rank plans alone from the all-gathered counts."""
    num_experts = 4
    routed = torch.stack([torch.bincount(e.reshape(-1), minlength=num_experts) for e in experts_per_rank])
    kept, first_token = set(), 0
    for rank, experts in enumerate(experts_per_rank):
        plan = plan_dispatch(experts, routed, rank, factor)
        topk = experts.shape[1]
        kept |= {(first_token + int(a) // topk, int(experts.reshape(-1)[a])) for a in plan.order}
        assert plan.kept[rank].tolist() == torch.bincount(experts.reshape(-1)[plan.order], minlength=4).tolist()
        first_token += experts.shape[0]
    return kept


def test_dropping_follows_the_global_order_of_tokens():
    # 2 experts, top-1: rank 0 chooses [0, 0, 1], rank 1 [0, 1, 1]; capacity ceil(0.5 * 6 / 2) = 2
    rank0, rank1 = torch.tensor([[0], [0], [1]]), torch.tensor([[0], [1], [1]])
    routed = torch.tensor([[2, 1], [1, 2]])
    plan1 = plan_dispatch(rank1, routed, 1, 0.5)
    assert plan1.capacity == 2 and plan1.order.tolist() == [1]  # its token 0 (expert 0) and 2 (expert 1) dropped
    assert plan1.kept.tolist() == [[2, 1], [0, 1]]
    single = plan_dispatch(torch.cat([rank0, rank1]), routed.sum(0, keepdim=True), 0, 0.5)
    assert sorted(single.order.tolist()) == [0, 1, 2, 4]
    # random top-2 choices of 2 and 3 ranks: the ranks together keep what the single process keeps
    g = torch.Generator().manual_seed(0)
    for ranks in (2, 3):
        per_rank = [torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7)]) for _ in range(ranks)]
        for factor in (0.5, 1.0):
            assert _kept_global(per_rank, factor) == _kept_global([torch.cat(per_rank)], factor)
        dropless = _kept_global(per_rank, None)
        assert len(dropless) == 7 * ranks * 2  # dropless keeps every assignment
    assert expert_capacity(10, 2, 4, 1.25) == math.ceil(1.25 * 10 * 2 / 4) and expert_capacity(10, 2, 4, None) is None


def _loop_reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Token by token: sum over its kept choices of weight * expert MLP (capacity by token order)."""
    routing = layer.router(x)
    ex, cfg = layer.experts, layer.config
    capacity = expert_capacity(x.shape[0], cfg.router_topk, cfg.num_experts, cfg.capacity_factor)
    seen = [0] * cfg.num_experts
    rows = []
    for t in range(x.shape[0]):
        y = torch.zeros(x.shape[1])
        for s in range(cfg.router_topk):
            e = int(routing.experts[t, s])
            seen[e] += 1
            if capacity is not None and seen[e] > capacity:
                continue
            h = F.linear(x[t], ex.fc1_weight[e], None if ex.fc1_bias is None else ex.fc1_bias[e])
            if cfg.activation == "gelu":
                h = F.gelu(h, approximate="tanh")
            else:
                gate, up = h.chunk(2)
                h = F.silu(gate) * up
            out = F.linear(h, ex.fc2_weight[e], None if ex.fc2_bias is None else ex.fc2_bias[e])
            y = y + routing.weights[t, s] * out
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_grouped_experts_match_a_per_token_loop(activation):
    torch.manual_seed(0)
    for factor, order in ((None, "softmax_topk"), (1.0, "topk_softmax"), (0.5, "softmax_topk")):
        layer = MoELayer(MoEConfig(16, 24, 4, 2, factor, score_order=order, activation=activation))
        with torch.no_grad():
            for p in layer.experts.parameters():
                p.normal_()  # biases too
        x = torch.randn(2, 12, 16)
        y = layer(x)
        torch.testing.assert_close(y.reshape(24, 16), _loop_reference(layer, x.reshape(24, 16)), rtol=1e-5, atol=1e-5)
        dropped = layer.last_stats["dropped_fraction"].item()
        assert (dropped == 0.0) if factor is None else (factor == 1.0 or dropped > 0.0)
        assert all(p.megazero_expert for p in layer.experts.parameters())
        assert not hasattr(layer.router.weight, "megazero_expert")


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_models_use_moe_every_freq_th_layer_and_train_on_the_aux_loss(model):
    from models.gpt import GPT, MLP, GPTConfig
    from models.llama import Llama, LlamaConfig, SwiGLU

    cls, config_cls, dense = (GPT, GPTConfig, MLP) if model == "gpt" else (Llama, LlamaConfig, SwiGLU)
    shape = dict(vocab_size=100, seq_length=8, num_layers=3, hidden_size=16, num_attention_heads=2,
                 make_vocab_size_divisible_by=16)
    assert all(isinstance(b.mlp, dense) for b in cls(config_cls(**shape)).blocks)  # off by default
    torch.manual_seed(0)
    moe = cls(config_cls(**shape, num_experts=4, moe_layer_freq=2, moe_capacity_factor=1.0, moe_z_loss_coeff=1e-3))
    assert [type(b.mlp).__name__ for b in moe.blocks] == ["MoELayer", dense.__name__, "MoELayer"]
    assert moe.blocks[0].mlp.experts.activation == ("gelu" if model == "gpt" else "swiglu")
    ids = torch.randint(0, 100, (2, 8))
    eval_loss = moe.eval()(ids, labels=ids)
    aux = moe_aux_loss(moe)
    assert aux.item() > 0
    torch.testing.assert_close(moe.train()(ids, labels=ids), eval_loss + aux)  # dropout 0: only the aux loss differs
    stats = moe_stats(moe)
    assert stats["load_balancing"] + stats["z_loss"] == pytest.approx(aux.item(), rel=1e-6)
    assert 0 < stats["dropped_fraction"] < 1 and stats["tokens_per_expert_min"] <= stats["tokens_per_expert_max"]
    assert moe_stats(cls(config_cls(**shape))) == {}
    # sequence parallelism builds sequence-parallel MoE layers (at one TP rank: the same model and loss;
    # TP=2: tests/distributed/test_moe.py, test_moe_engine.py)
    torch.manual_seed(0)
    sp = cls(config_cls(**shape, num_experts=4, moe_layer_freq=2, moe_capacity_factor=1.0, moe_z_loss_coeff=1e-3,
                        sequence_parallel=True))
    assert [b.mlp.config.sequence_parallel for b in sp.blocks if not isinstance(b.mlp, dense)] == [True, True]
    torch.testing.assert_close(sp.train()(ids, labels=ids), moe(ids, labels=ids))
