"""Each tensor-parallel layer against its dense counterpart: forward, input and weight gradients,
and the initialisation (rank r's shard is the slice of the dense layer built from the same seed)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import tensor_parallel as tp
from megazero.parallel_state import initialize_model_parallel

TOL = dict(rtol=1e-5, atol=1e-6)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _shard(full: torch.Tensor, dim: int, stride: int = 1) -> torch.Tensor:
    group = dist.group.WORLD
    return tp.shard_of(full, dim, dist.get_world_size(group), dist.get_rank(group), stride)


def _linear_layers(sequence_parallel: bool) -> None:
    group = initialize_model_parallel(dist.get_world_size(), 1).tp_group
    world = dist.get_world_size()
    for gather_output in (True, False):
        torch.manual_seed(0)
        column = tp.ColumnParallelLinear(8, 12, group, gather_output=gather_output, stride=3,
                                         init_method=torch.nn.init.normal_, sequence_parallel=sequence_parallel)
        dense = torch.nn.Linear(8, 12)
        torch.manual_seed(0)
        torch.nn.init.normal_(dense.weight)
        torch.nn.init.zeros_(dense.bias)
        _close(column.weight, _shard(dense.weight.detach(), 0, 3), "initial column shard")
        x = torch.randn(2, 4 * world, 8, requires_grad=True)
        dense_x = x.detach().clone().requires_grad_()
        local_x = tp.scatter_to_sequence_parallel_region(x, group) if sequence_parallel else x
        y = column(local_x)
        expected = dense(dense_x)
        _close(y, expected if gather_output else _shard(expected, -1, 3), "column forward")
        upstream = torch.randn_like(expected)
        (y * (upstream if gather_output else _shard(upstream, -1, 3))).sum().backward()
        (expected * upstream).sum().backward()
        _close(column.weight.grad, _shard(dense.weight.grad, 0, 3), "column weight grad")
        _close(column.bias.grad, _shard(dense.bias.grad, 0, 3), "column bias grad")
        _close(x.grad, dense_x.grad, "column input grad")
    for input_is_parallel in (True, False):
        torch.manual_seed(1)
        row = tp.RowParallelLinear(12, 8, group, input_is_parallel=input_is_parallel,
                                   init_method=torch.nn.init.normal_, sequence_parallel=sequence_parallel)
        dense = torch.nn.Linear(12, 8)
        torch.manual_seed(1)
        torch.nn.init.normal_(dense.weight)
        torch.nn.init.zeros_(dense.bias)
        with torch.no_grad():
            dense.bias.uniform_()
            row.bias.copy_(dense.bias)
        _close(row.weight, _shard(dense.weight.detach(), 1), "initial row shard")
        x = torch.randn(2, 4 * world, 12, requires_grad=True)
        dense_x = x.detach().clone().requires_grad_()
        y = row(_shard(x, -1) if input_is_parallel else x)
        expected = dense(dense_x)
        _close(y, tp.scatter_to_sequence_parallel_region(expected, group) if sequence_parallel else expected,
               "row forward")
        upstream = torch.randn_like(expected)
        local_upstream = tp.scatter_to_sequence_parallel_region(upstream, group) if sequence_parallel else upstream
        (y * local_upstream).sum().backward()
        (expected * upstream).sum().backward()
        _close(row.weight.grad, _shard(dense.weight.grad, 1), "row weight grad")
        _close(row.bias.grad, dense.bias.grad, "row bias grad")
        if input_is_parallel:  # this rank's columns of the input got their gradient, the rest none
            _close(_shard(x.grad, -1), _shard(dense_x.grad, -1), "row input grad")
        else:
            _close(x.grad, dense_x.grad, "row input grad")


def _embedding_and_cross_entropy() -> None:
    group = initialize_model_parallel(dist.get_world_size(), 1).tp_group
    torch.manual_seed(0)
    embedding = tp.VocabParallelEmbedding(32, 6, group)
    dense = torch.nn.Embedding(32, 6)
    torch.manual_seed(0)
    torch.nn.init.normal_(dense.weight)
    _close(embedding.weight, _shard(dense.weight.detach(), 0), "initial embedding shard")
    ids = torch.randint(0, 32, (3, 7))
    out, expected = embedding(ids), dense(ids)
    _close(out, expected, "embedding forward")
    upstream = torch.randn_like(expected)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    _close(embedding.weight.grad, _shard(dense.weight.grad, 0), "embedding grad")

    logits = torch.randn(3, 7, 32, requires_grad=True)
    target = torch.randint(0, 32, (3, 7))
    local = _shard(logits.detach(), -1).requires_grad_()
    loss = tp.vocab_parallel_cross_entropy(local, target, group)
    expected = F.cross_entropy(logits.view(-1, 32), target.view(-1), reduction="none").view(3, 7)
    _close(loss, expected, "cross entropy")
    weights = torch.rand(3, 7)
    (loss * weights).sum().backward()
    (expected * weights).sum().backward()
    _close(local.grad, _shard(logits.grad, -1), "cross entropy grad")


def _sequence_parallel_layer_norm() -> None:
    group = initialize_model_parallel(dist.get_world_size(), 1).tp_group
    norm = tp.LayerNorm(6, tp_group=group, sequence_parallel=True)
    dense = torch.nn.LayerNorm(6)
    with torch.no_grad():
        for p in (norm.weight, norm.bias, dense.weight, dense.bias):
            p.copy_(torch.linspace(0.5, 1.5, 6))
    x = torch.randn(2, 4 * dist.get_world_size(), 6)
    upstream = torch.randn_like(x)
    (norm(tp.scatter_to_sequence_parallel_region(x, group))
     * tp.scatter_to_sequence_parallel_region(upstream, group)).sum().backward()
    (dense(x) * upstream).sum().backward()
    _close(norm.weight.grad, dense.weight.grad, "sequence-parallel LayerNorm weight grad (summed over ranks)")
    _close(norm.bias.grad, dense.bias.grad, "sequence-parallel LayerNorm bias grad")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_linear_layers_match_dense(pools, world_size, sequence_parallel):
    pools(world_size).run(_linear_layers, sequence_parallel)


@pytest.mark.parametrize("world_size", [2, 4])
def test_embedding_and_cross_entropy_match_dense(pools, world_size):
    pools(world_size).run(_embedding_and_cross_entropy)


def test_sequence_parallel_layer_norm_grads_are_summed(pools):
    pools(2).run(_sequence_parallel_layer_norm)


def _rng_tracker() -> list[float]:
    initialize_model_parallel(dist.get_world_size(), 1)
    tp.model_parallel_seed(5, dist.get_rank())
    with tp.get_rng_tracker().fork():
        inside = torch.rand(1).item()
    return [inside, torch.rand(1).item()]


def test_rng_tracker_differs_inside_and_agrees_outside(pools):
    (inside0, outside0), (inside1, outside1) = pools(2).run(_rng_tracker)
    assert inside0 != inside1
    assert outside0 == outside1
