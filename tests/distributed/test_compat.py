"""megazero.compat: the fallback for a torch without reduce_scatter_single (torch 2.11) gives what
torch's own gives: bit for bit on 2 gloo ranks (a sum of two), within fp32 rounding on 4 (the
summing order differs); and the torch running is at least the oldest supported one."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero import compat


def _both_ways() -> bool:
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    data = torch.randn(world * 1000, generator=g)
    mine = torch.empty(1000)
    compat.reduce_scatter_by_chunks(mine, data)
    expected = torch.empty(1000)
    if compat._NATIVE_REDUCE_SCATTER_SINGLE is not None:
        compat._NATIVE_REDUCE_SCATTER_SINGLE(expected, data.clone())
    else:  # this torch lacks it: the sum by all-reduce
        whole = data.clone()
        dist.all_reduce(whole)
        expected = whole.view(world, -1)[rank]
    return torch.equal(mine, expected) if world == 2 else torch.allclose(mine, expected, rtol=1e-6, atol=1e-6)


def test_reduce_scatter_fallback_matches_torch(pools):
    assert pools(2).run(_both_ways) == [True, True]
    assert pools(4).run(_both_ways) == [True] * 4


def test_torch_is_at_least_the_oldest_supported():
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert version >= tuple(int(x) for x in compat.TORCH_MIN.split("."))
