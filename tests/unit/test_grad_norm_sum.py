"""The gradient norm's pieces are added up without reading any back to the host: CPU tensors by
the fused one-pass kernel into a float (as before), GPU tensors into a float64 scalar on their
device (its arithmetic, squared_norms_on_device, checked here on CPU tensors); one .item() per
step reads the total."""

from __future__ import annotations

import math

import torch

from megazero.zero.master_partitions import SquaredNormSum, squared_norm, squared_norms_on_device


def _tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    flat = torch.randn(1000, generator=generator)
    return [flat[:300], flat[300:301], flat[301:], torch.randn(7, 5, generator=generator).t(), torch.empty(0)]


def test_cpu_pieces_add_up_exactly_as_the_floats_did():
    tensors = _tensors()
    expected = 0.0
    total = SquaredNormSum()
    for group in (tensors[:2], tensors[2:]):
        expected += sum(squared_norm(t) for t in group)
        total.add(group)
    result = total.total()
    assert result.dtype == torch.float64 and result.device.type == "cpu"
    assert result.item() == expected


def test_the_device_arithmetic_matches_the_float_sum_and_propagates_inf_and_nan():
    tensors = _tensors()
    reference = sum(float(torch.linalg.vector_norm(t)) ** 2 for t in tensors)
    assert math.isclose(squared_norms_on_device(tensors).item(), reference, rel_tol=1e-12)
    assert squared_norms_on_device([*tensors, torch.tensor([float("inf")])]).item() == math.inf
    assert math.isnan(squared_norms_on_device([torch.tensor([1.0, float("nan")]), *tensors]).item())


def test_nothing_added_is_zero():
    assert SquaredNormSum().total().item() == 0.0
