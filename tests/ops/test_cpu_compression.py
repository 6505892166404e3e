"""The 1-bit compression op (csrc/cpu_compression.cpp) against its pure-torch reference in
megazero/optim/compression.py (bit for bit: the same signs, scales, errors and decoded means), the
block layout, and what error feedback promises: what is sent plus the new error is exactly what
was to be sent."""

from __future__ import annotations

import pytest
import torch

from megazero.optim import compression
from megazero.optim.compression import BLOCK, BlockLayout, compress, decode, decode_mean, pack_signs, unpack_signs


@pytest.fixture(scope="module", autouse=True)
def built():
    if compression.compression_op() is None:
        pytest.fail("the cpu_compression op did not build")


@pytest.fixture
def reference(monkeypatch):
    """Run the module's torch code instead of the op."""
    monkeypatch.setattr(compression, "compression_op", lambda: None)


def _inputs(layout: BlockLayout, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(layout.numel, generator=generator)
    values[::7] = 0.0  # zero is positive, and so is -0.0
    values[3::11] = -0.0
    error = 0.1 * torch.randn(layout.numel, generator=generator)
    values[layout.padding] = 0.0
    error[layout.padding] = 0.0
    return values, error


def test_the_layout_starts_every_tensor_on_a_block_and_fills_whole_server_chunks():
    layout = BlockLayout([5000, 10, 4096, 1], world=2)
    assert layout.offsets == [0, 3 * BLOCK, 4 * BLOCK, 6 * BLOCK]
    assert layout.numel == 8 * BLOCK  # 7 blocks, rounded up to whole chunks of 2 ranks
    assert layout.counts.tolist() == [2048, 2048, 904, 10, 2048, 2048, 1, 1]
    assert layout.padding.numel() == layout.numel - (5000 + 10 + 4096 + 1)


def test_signs_pack_high_bit_first_and_round_trip():
    values = torch.tensor([1.0, -1.0, 0.0, -0.0, -3.0, 2.0, -1e-30, 5.0])
    assert pack_signs(values).tolist() == [0b10110101]
    x = torch.randn(8 * 1000)
    assert torch.equal(unpack_signs(pack_signs(x)), x >= 0)


@pytest.mark.parametrize("numels", [[5000, 10, 4096, 1], [300_000]])
def test_compress_and_decode_match_the_reference(reference, numels, monkeypatch):
    layout = BlockLayout(numels, world=2)
    values, error = _inputs(layout, 0)
    expected_error = error.clone()
    expected = compress(values, expected_error, layout.counts, layout.padding, BLOCK)
    rows = torch.stack([expected[0], pack_signs(-values)]), torch.stack([expected[1], 2 * expected[1]])
    expected_mean = decode_mean(*rows, BLOCK)
    monkeypatch.undo()  # the op from here
    got = compress(values, error, layout.counts, layout.padding, BLOCK)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(error, expected_error)
    assert torch.equal(decode_mean(*rows, BLOCK), expected_mean)


def test_error_feedback_keeps_what_the_signs_leave_out():
    """decode(signs, scales) + new error == values + old error (to fp32 rounding), zero on padding;
    each block's scale is the root mean square of its real elements."""
    layout = BlockLayout([5000, 10, 4096], world=1)
    values, error = _inputs(layout, 1)
    before = values + error
    bits, scales = compress(values, error, layout.counts, layout.padding, BLOCK)
    sent = decode(bits, scales, BLOCK)
    real = torch.ones(layout.numel, dtype=torch.bool)
    real[layout.padding] = False
    torch.testing.assert_close((sent + error)[real], before[real], rtol=0, atol=1e-6)
    assert not error[layout.padding].any()
    rms = (before[:BLOCK].double().square().mean().sqrt()).float()
    assert scales[0] == rms and scales[3] == (before[6144:6154].double().square().mean().sqrt()).float()

