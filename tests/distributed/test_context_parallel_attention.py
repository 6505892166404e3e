"""The context-parallel attention paths on gloo ranks against torch's attention over the whole
sequence: ring attention (causal and not) and all-to-all (Ulysses) attention, at CP=2 and CP=4,
with grouped-query heads, and ring attention with what queries see narrowed: BERT's key padding
(whole key chunks padded, so skipped blocks and rows that see nothing of a block) and packed
documents (boundaries inside and across chunks); the output of each rank's tokens and the
gradients of its q, k and v equal the whole-sequence reference's for those tokens. Two broken
variants (the log-sum-exp merge replaced by a plain average, and the contiguous split instead of
the load-balanced one) are run as controls: the comparison catches both."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero.context_parallel import ring, split
from megazero.context_parallel.split import load_balanced_positions, split_sequence

TOLERANCE = 1e-5


def _inputs(heads: int, kv_heads: int, seq: int):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, seq, 8, generator=generator)
    k, v = (torch.randn(2, kv_heads, seq, 8, generator=generator) for _ in range(2))
    weight = torch.randn(2, heads, seq, 8, generator=generator)  # loss = (out * weight).sum(): every output counts
    return q, k, v, weight


def _reference(q, k, v, weight, causal: bool):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _errors(path: str, heads: int, kv_heads: int, seq: int, causal: bool) -> float:
    """Largest difference of this rank's output and q/k/v gradients from the reference's."""
    group = dist.group.WORLD
    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, weight = _inputs(heads, kv_heads, seq)
    expected = _reference(q, k, v, weight, causal)
    mine = [split_sequence(t, cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
    if path == "ring":
        out = ring.ring_attention(*mine, group, causal=causal)
    else:
        from megazero.context_parallel import ulysses_attention

        out = ulysses_attention(*mine, group, lambda a, b, c: F.scaled_dot_product_attention(
            a, b, c, is_causal=causal, enable_gqa=a.shape[1] != b.shape[1]))
    (out * split_sequence(weight, cp, rank, dim=2)).sum().backward()
    got = [out.detach()] + [t.grad for t in mine]
    return max(float((a - split_sequence(b, cp, rank, dim=2)).abs().max()) for a, b in zip(got, expected))


SEQ = 16
# sample 0: the last 6 keys are padding (chunk 7 whole at CP 4); sample 1: the last 9
KEY_VALID = torch.arange(SEQ)[None, :] < torch.tensor([[SEQ - 6], [SEQ - 9]])
# sample 0: documents [0, 3) [3, 9) [9, 16); sample 1: [0, 13) [13, 16)
DOCUMENT_IDS = torch.tensor([[0] * 3 + [1] * 6 + [2] * 7, [0] * 13 + [1] * 3])


def _masked_errors(visibility: str) -> float:
    """_errors' comparison for ring attention over 4 heads (2 key/value heads) where queries see
    only the real keys (visibility "padding", not causal) or their own document ("documents")."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, weight = _inputs(4, 2, SEQ)
    if visibility == "padding":
        visible, causal, mask = ring.Visible(key_valid=KEY_VALID), False, KEY_VALID[:, None, None, :]
    else:
        same = DOCUMENT_IDS[:, None, :, None] == DOCUMENT_IDS[:, None, None, :]
        visible, causal, mask = ring.Visible(document_ids=DOCUMENT_IDS), True, same & torch.ones(SEQ, SEQ).bool().tril()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
    (expected * weight).sum().backward()
    expected = [expected.detach()] + [t.grad for t in leaves]
    mine = [split_sequence(t, cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
    out = ring.ring_attention(*mine, dist.group.WORLD, causal=causal, visible=visible)
    (out * split_sequence(weight, cp, rank, dim=2)).sum().backward()
    got = [out.detach()] + [t.grad for t in mine]
    return max(float((a - split_sequence(b, cp, rank, dim=2)).abs().max()) for a, b in zip(got, expected))


def _broken(variant: str) -> float:
    """_errors of causal ring attention with the merge or the split broken."""
    if variant == "merge":  # the blocks averaged instead of weighted by their log-sum-exp
        original = ring._merge
        ring._merge = lambda out, lse, block_out, block_lse: ((out + block_out) / 2, torch.logaddexp(lse, block_lse))
    else:  # rank r holds chunks 2r and 2r + 1: the contiguous split, not Megatron's load balancing
        original = split.load_balanced_positions

        def contiguous(seq_length, cp_size, cp_rank, device=None):
            local = seq_length // cp_size
            return torch.arange(cp_rank * local, (cp_rank + 1) * local, device=device)

        split.load_balanced_positions = contiguous
    try:
        return _errors("ring", 4, 2, 16, True)
    finally:
        if variant == "merge":
            ring._merge = original
        else:
            split.load_balanced_positions = original


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("path,causal", [("ring", True), ("ring", False), ("ulysses", True)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_context_parallel_attention_equals_the_whole_sequence(pools, world, path, causal, heads, kv_heads):
    for error in pools(world).run(_errors, path, heads, kv_heads, 16, causal):
        assert error < TOLERANCE


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("visibility", ["padding", "documents"])
def test_ring_attention_sees_what_the_mask_leaves(pools, world, visibility):
    for error in pools(world).run(_masked_errors, visibility):
        assert error < TOLERANCE


def test_the_comparison_catches_a_broken_merge_or_split(pools):
    assert min(pools(2).run(_broken, "merge")) > 1e-2
    assert min(pools(2).run(_broken, "split")) > 1e-2
    assert load_balanced_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def _heads_not_divisible() -> str:
    from megazero.context_parallel import ulysses_attention

    q = torch.zeros(1, 3, 4, 8)
    try:
        ulysses_attention(q, q, q, dist.group.WORLD, F.scaled_dot_product_attention)
    except ValueError as e:
        return str(e)
    return "no error"


def test_ulysses_names_heads_not_divisible_by_cp(pools):
    for message in pools(2).run(_heads_not_divisible):
        assert "(3) must be divisible by context_parallel_size (2)" in message
