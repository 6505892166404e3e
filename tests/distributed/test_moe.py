"""The MoE layer at EP=2 and TP=2 (2 gloo ranks, groups built here with dist.new_group) against
the single-process layer built from the same seed on the whole batch: outputs, input gradients,
the experts' gradients (this rank's slice / TP shard of the reference's), the router's gradient
(summed over the EP group), the auxiliary losses and the statistics, in dropless and capacity
mode (the same tokens dropped); at TP=2 also with sequence parallelism (each rank's slice of the
sequence in and out). Also the all-to-all autograd function on its own, and a 2-layer
MoE GPT at EP = DP = 2 against the single-process GPT on the whole batch (loss and every gradient,
averaged over DP as the engine does)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megazero.moe import MoEConfig, MoELayer
from megazero.moe.comm import all_to_all
from megazero.moe.experts import GroupedExperts, expert_slice, merge_expert_slices
from megazero.tensor_parallel.utils import shard_of

TOL = dict(rtol=1e-6, atol=1e-6)
# (capacity factor, topk, score order, activation): dropless and capacity mode, both score orders
CASES = [(None, 2, "softmax_topk", "gelu"), (0.75, 2, "topk_softmax", "swiglu"), (0.5, 1, "softmax_topk", "gelu")]


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"rank {dist.get_rank()}: {what}: {m}")


def _layers(case: tuple, ep_group=None, tp_group=None) -> tuple[MoELayer, MoELayer]:
    factor, topk, order, activation = case
    config = MoEConfig(16, 24, 4, topk, factor, aux_loss_coeff=0.1, z_loss_coeff=0.01, score_order=order,
                       activation=activation)
    torch.manual_seed(0)
    layer = MoELayer(config, ep_group, tp_group)
    torch.manual_seed(0)
    return layer, MoELayer(config)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g)


def _expert_parallel_matches_single_process() -> list[float]:
    group = dist.new_group([0, 1])
    rank, ep = dist.get_rank(group), dist.get_world_size(group)
    dropped = []
    for case in CASES:
        layer, reference = _layers(case, ep_group=group)
        x, upstream = _batch()
        mine = slice(0, 10) if rank == 0 else slice(10, 24)  # unequal token counts per rank
        local_x = x[mine].clone().requires_grad_()
        y = layer(local_x)
        # every rank adds the EP group's aux losses; the DP average of the ranks' losses counts them once
        ((y * upstream[mine]).sum() + layer.aux_loss() / ep).backward()
        whole_x = x.clone().requires_grad_()
        expected = reference(whole_x)
        ((expected * upstream).sum() + reference.aux_loss()).backward()
        _close(y, expected[mine], f"{case} output")
        _close(local_x.grad, whole_x.grad[mine], f"{case} input grad")
        experts = layer.experts.global_expert_indices()
        assert list(experts) == [2 * rank, 2 * rank + 1]
        for name, param in layer.experts.named_parameters():
            full = getattr(reference.experts, name)
            _close(param, full[experts.start:experts.stop], f"{case} initial {name}")
            _close(param.grad, full.grad[experts.start:experts.stop], f"{case} {name} grad")
        router_grad = layer.router.weight.grad.clone()
        dist.all_reduce(router_grad, group=group)
        _close(router_grad, reference.router.weight.grad, f"{case} router grad (summed over EP)")
        for key in ("load_balancing", "z_loss"):
            _close(layer.last_aux_losses[key], reference.last_aux_losses[key], f"{case} {key}")
        for key, value in reference.last_stats.items():
            _close(layer.last_stats[key], value, f"{case} {key}")
        dropped.append(layer.last_stats["dropped_fraction"].item())
    with pytest.raises(ValueError, match="num_experts 3 is not divisible by the expert-parallel size 2"):
        GroupedExperts(3, 16, 24, ep_group=group)
    # a checkpoint's [E, ...] tensors from the ranks' slices, re-cut at another EP size
    gathered = [torch.empty_like(layer.experts.fc1_weight) for _ in range(ep)]
    dist.all_gather(gathered, layer.experts.fc1_weight.detach(), group=group)
    whole = merge_expert_slices(gathered)
    _close(whole, reference.experts.fc1_weight.detach(), "merged expert slices")
    _close(expert_slice(whole, 4, 3), reference.experts.fc1_weight.detach()[3:], "EP=4 slice of rank 3")
    return dropped


def _tensor_parallel_experts_match_single_process() -> None:
    group = dist.new_group([0, 1])
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    for case in CASES[:2]:
        layer, reference = _layers(case, tp_group=group)
        x, upstream = _batch()  # the same tokens on both TP ranks
        local_x, whole_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        ((layer(local_x) * upstream).sum() + layer.aux_loss()).backward()
        expected = reference(whole_x)
        ((expected * upstream).sum() + reference.aux_loss()).backward()
        _close(layer(x), expected, f"{case} TP output")
        _close(local_x.grad, whole_x.grad, f"{case} TP input grad")
        _close(layer.router.weight.grad, reference.router.weight.grad, f"{case} TP router grad")
        for name, param in layer.experts.named_parameters():
            full = getattr(reference.experts, name).grad
            if getattr(param, "tensor_model_parallel", False):
                full = shard_of(full, param.partition_dim, tp, rank, param.partition_stride)
            _close(param.grad, full, f"{case} TP {name} grad")


def _sequence_parallel_layer_matches_single_process() -> None:
    group = dist.new_group([0, 1])
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    for case in CASES:
        layer, reference = _layers(case, tp_group=group)
        layer.config.sequence_parallel = True
        x, upstream = (t.view(2, 12, 16) for t in _batch())  # [batch, seq, hidden]
        mine = slice(6 * rank, 6 * rank + 6)  # this rank's half of the sequence
        local_x, whole_x = x[:, mine].clone().requires_grad_(), x.clone().requires_grad_()
        y = layer(local_x)
        # every TP rank adds the same aux losses (the model's loss is the same on every TP rank)
        ((y * upstream[:, mine]).sum() + layer.aux_loss()).backward()
        expected = reference(whole_x)
        ((expected * upstream).sum() + reference.aux_loss()).backward()
        _close(y, expected[:, mine], f"{case} SP output")
        _close(local_x.grad, whole_x.grad[:, mine], f"{case} SP input grad")
        _close(layer.router.weight.grad, reference.router.weight.grad, f"{case} SP router grad")
        for name, param in layer.experts.named_parameters():
            full = getattr(reference.experts, name).grad
            if getattr(param, "tensor_model_parallel", False):
                full = shard_of(full, param.partition_dim, tp, rank, param.partition_stride)
            _close(param.grad, full, f"{case} SP {name} grad")
        for key in ("load_balancing", "z_loss"):
            _close(layer.last_aux_losses[key], reference.last_aux_losses[key], f"{case} SP {key}")
        for key, value in reference.last_stats.items():  # the same tokens dropped
            _close(layer.last_stats[key], value, f"{case} SP {key}")


def _all_to_all_gradients() -> None:
    group = dist.new_group([0, 1])
    rank = dist.get_rank(group)
    splits = [[1, 3], [2, 0]]  # splits[i][j]: rows rank i sends to rank j
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(sum(s), 3, generator=g) for s in splits]
    weights = [torch.randn(sum(s[j] for s in splits), 3, generator=g) for j in range(2)]
    # the single-process computation: rank j receives, in source order, the rows sent to it
    whole = [x.clone().requires_grad_() for x in xs]
    received = [torch.cat([whole[i][sum(splits[i][:j]):sum(splits[i][:j + 1])] for i in range(2)]) for j in range(2)]
    sum((r * w).sum() for r, w in zip(received, weights)).backward()
    local = xs[rank].clone().requires_grad_()
    out = all_to_all(local, [splits[i][rank] for i in range(2)], splits[rank], group)
    _close(out, received[rank].detach(), "all_to_all forward")
    (out * weights[rank]).sum().backward()
    _close(local.grad, whole[rank].grad, "all_to_all backward")


def _moe_gpt_matches_single_process() -> None:
    from models.gpt import GPT, GPTConfig

    group = dist.new_group([0, 1])
    rank, dp = dist.get_rank(group), dist.get_world_size(group)
    config = GPTConfig(vocab_size=100, seq_length=8, num_layers=2, hidden_size=16, num_attention_heads=2,
                       make_vocab_size_divisible_by=16, num_experts=4, moe_capacity_factor=1.0, moe_z_loss_coeff=1e-3)
    torch.manual_seed(0)
    model = GPT(config, ep_group=group)
    torch.manual_seed(0)
    reference = GPT(config)
    ids = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(3))
    loss = model(ids[2 * rank:2 * rank + 2], labels=ids[2 * rank:2 * rank + 2])  # EP = DP = 2: half the batch
    loss.backward()
    expected = reference(ids, labels=ids)
    expected.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=group)
    _close(mean / dp, expected.detach(), "GPT loss (the DP average)")
    for name, param in model.named_parameters():
        full = reference.get_parameter(name).grad
        grad = param.grad.clone()
        if getattr(param, "megazero_expert", False):
            # these experts' gradients already hold every DP rank's tokens (the all-to-all brought
            # them here): the engine's average divides them by the DP size, reducing over expert-DP only
            first = param.megazero_expert_first
            full = full[first:first + param.shape[0]]
        else:
            dist.all_reduce(grad, group=group)
        _close(grad / dp, full, f"GPT {name} grad")


def test_expert_parallel_layer_matches_single_process(pools):
    pool = pools(2)
    pool.run(_all_to_all_gradients)
    dropped = pool.run(_expert_parallel_matches_single_process)[0]
    assert dropped[0] == 0.0 and dropped[1] > 0.0 and dropped[2] > 0.0  # dropless, then capacity mode drops
    pool.run(_moe_gpt_matches_single_process)


def test_tensor_parallel_experts_match_single_process(pools):
    pool = pools(2)
    pool.run(_tensor_parallel_experts_match_single_process)
    pool.run(_sequence_parallel_layer_matches_single_process)
