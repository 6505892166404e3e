"""Ring attention (Megatron-Core's p2p context parallelism): each rank keeps its query tokens and
the key/value blocks travel round the ring of the context-parallel group, the next block's
exchange running while the current block computes. Each block's attention is merged into the
running output by the log-sum-exp rule

    lse = logaddexp(lse_a, lse_b),  out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

which equals softmax attention over the union of the blocks. Tokens are in the load-balanced
order (megazero.context_parallel.split: rank r holds chunks r and 2 CP - 1 - r); under the causal
mask a query chunk sees earlier chunks whole, its own chunk causally and later chunks not at all,
and those block pairs are skipped.

Only q, k, v, the output and the log-sum-exp are kept for backward (no block's probabilities):
backward recomputes each block's probabilities from the final log-sum-exp, as flash attention
does, and the key/value gradients travel round the ring with their block and a last hop takes
them home. On CPUs each block runs torch's fused flash-attention kernels (forward returns the
block's log-sum-exp, backward takes the row's); with dropout masks, and on other devices, the
math is written out in fp32.

q is [batch, heads, tokens here, d], k and v [batch, key/value heads, tokens here, d] (grouped-query
attention: each key/value head serves consecutive query heads). `dropout_mask` [batch, heads, seq,
seq] (the whole sequence, global order; the layout-invariant dropout mode's): each block's
probabilities are multiplied by its part of it, in forward and backward alike. `visible` narrows
what each query sees beyond the causal mask (BERT's padding, packed documents); block pairs where
it leaves nothing are skipped like the causally masked ones.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from megazero.context_parallel.comm import exposed
from megazero.context_parallel.split import chunk_ids


@dataclasses.dataclass(frozen=True)
class Visible:
    """What each query may see beyond the causal mask, over the whole sequence in global order:
    keys that are real tokens (`key_valid` [batch, seq] bool: BERT's padding mask) and keys of the
    query's own document (`document_ids` [batch, seq]: packed documents)."""

    key_valid: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None

    def block(self, queries: slice, keys: slice, causal: bool) -> torch.Tensor | None:
        """[batch, 1, queries, keys] bool (True: seen) of one block pair, causal within the pair
        where `causal`; None where every key is seen (and the pair is not causal)."""
        seen = None
        if self.key_valid is not None:
            seen = self.key_valid[:, None, None, keys]
        if self.document_ids is not None:
            ids = self.document_ids
            same = ids[:, None, queries, None] == ids[:, None, None, keys]
            seen = same if seen is None else seen & same
        if seen is not None and causal:
            seen = seen & torch.ones(seen.shape[-2], seen.shape[-1], dtype=torch.bool, device=seen.device).tril()
        return seen


NOTHING_HIDDEN = Visible()


class _Shift:
    """One ring hop of a tensor, started now and waited for later (the overlap)."""

    def __init__(self, x: torch.Tensor, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.out = torch.empty_like(x)
        self.requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, x, dist.get_global_rank(group, (rank + 1) % world), group),
            dist.P2POp(dist.irecv, self.out, dist.get_global_rank(group, (rank - 1) % world), group)])

    def result(self) -> torch.Tensor:
        """The previous rank's tensor."""
        with exposed.blocked():
            for request in self.requests:
                request.wait()
        return self.out


@dataclasses.dataclass(frozen=True)
class _Pair:
    """One block pair: this rank's query half `i` against the travelling block's key/value half
    `j` (chunks q_id and kv_id of the sequence); `seen` its visibility mask (None: causal only
    where `causal`, else everything)."""

    i: int
    j: int
    causal: bool
    q_id: int
    kv_id: int
    seen: torch.Tensor | None


def _pairs(cp_size: int, cp_rank: int, source: int, causal: bool, visible: Visible, chunk: int):
    """The block pairs to compute when this rank holds the block of `source` (pairs that are fully
    masked, causally or by `visible`, left out)."""
    for i, q_id in enumerate(chunk_ids(cp_size, cp_rank)):
        for j, kv_id in enumerate(chunk_ids(cp_size, source)):
            if causal and kv_id > q_id:
                continue
            pair_causal = causal and kv_id == q_id
            seen = visible.block(slice(q_id * chunk, (q_id + 1) * chunk), slice(kv_id * chunk, (kv_id + 1) * chunk),
                                 pair_causal)
            if seen is not None and not bool(seen.any()):
                continue
            yield _Pair(i, j, pair_causal, q_id, kv_id, seen)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, seen: torch.Tensor | None) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if seen is None and causal:
        seen = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return scores if seen is None else scores.masked_fill(~seen, float("-inf"))


def _additive(seen: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The fused kernel's form of a visibility mask: 0 where seen, -inf elsewhere."""
    if seen is None:
        return None
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))


def _block_mask(dropout_mask: torch.Tensor | None, q_id: int, kv_id: int, chunk: int) -> torch.Tensor | float:
    """The dropout mask of the (query chunk, key chunk) block (1.0 without dropout)."""
    if dropout_mask is None:
        return 1.0
    return dropout_mask[:, :, q_id * chunk:(q_id + 1) * chunk, kv_id * chunk:(kv_id + 1) * chunk]


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = x.shape[2] // 2
    return x[:, :, :half], x[:, :, half:]


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated to one per query head."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of _expand: each key/value head's query heads summed."""
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The running (output, log-sum-exp) with one more block's merged in."""
    merged = torch.logaddexp(lse, block_lse)
    safe = merged.masked_fill(merged == float("-inf"), 0.0)  # rows that have seen no key yet: both weights 0
    return out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None], merged


def _fused(x: torch.Tensor, dropout_mask: torch.Tensor | None) -> bool:
    """Whether the blocks run on torch's fused CPU attention kernels (which return the log-sum-exp
    and take it back in backward); the written-out math otherwise (dropout masks, other devices)."""
    return dropout_mask is None and x.device.type == "cpu"


def _block_forward(q, k, v, pair: _Pair, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of one block pair, fp32, -inf log-sum-exp for rows that see no key
    of the block; q, k, v in the model's dtype."""
    if _fused(q, mask if torch.is_tensor(mask) else None):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, pair.causal and pair.seen is None, attn_mask=_additive(pair.seen, q.dtype))
        lse = lse.float()
        if pair.seen is not None:  # the kernel gives a row that sees nothing output 0 and log-sum-exp 0
            lse = lse.masked_fill(~pair.seen.any(-1), float("-inf"))
        return out.float(), lse
    scores = _scores(q.float(), k.float(), pair.causal, pair.seen)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    return torch.matmul(probs * mask, v.float()), lse


def _block_backward(dout, q, k, v, out, lse, pair: _Pair, mask) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) in fp32 of one block pair, from the whole row's output and log-sum-exp (the
    block's share of the gradient, as flash attention's backward computes it)."""
    if _fused(q, mask if torch.is_tensor(mask) else None):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, pair.causal and pair.seen is None,
            attn_mask=_additive(pair.seen, q.dtype))
        return tuple(g.float() for g in grads)
    qf, kf, vf, doutf = q.float(), k.float(), v.float(), dout.float()
    probs = torch.exp(_scores(qf, kf, pair.causal, pair.seen) - lse[..., None])
    delta = (doutf * out.float()).sum(-1, keepdim=True)  # rowsum(dO o O), flash attention's D
    dscores = probs * (torch.matmul(doutf, vf.transpose(-2, -1)) * mask - delta) / math.sqrt(q.shape[-1])
    return (torch.matmul(dscores, kf), torch.matmul(dscores.transpose(-2, -1), qf),
            torch.matmul((probs * mask).transpose(-2, -1), doutf))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, dropout_mask, visible):
        cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        heads, chunk = q.shape[1], q.shape[2] // 2
        q_h = [half.contiguous() for half in _halves(q)]
        out = [torch.zeros(half.shape, device=q.device) for half in q_h]
        lse = [torch.full(half.shape[:3], float("-inf"), device=q.device) for half in q_h]
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp_size):
            coming = _Shift(kv, group) if step < cp_size - 1 else None
            keys, values = ([half.contiguous() for half in _halves(_expand(t, heads))] for t in kv)
            for pair in _pairs(cp_size, cp_rank, (cp_rank - step) % cp_size, causal, visible, chunk):
                block = _block_forward(q_h[pair.i], keys[pair.j], values[pair.j], pair,
                                       _block_mask(dropout_mask, pair.q_id, pair.kv_id, chunk))
                out[pair.i], lse[pair.i] = _merge(out[pair.i], lse[pair.i], *block)
            if coming is not None:
                kv = coming.result()
        out, lse = torch.cat(out, dim=2).to(q.dtype), torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out, lse, dropout_mask)
        ctx.group, ctx.causal, ctx.visible = group, causal, visible
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, dropout_mask = ctx.saved_tensors
        group, causal, visible = ctx.group, ctx.causal, ctx.visible
        cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        heads, kv_heads, chunk = q.shape[1], k.shape[1], q.shape[2] // 2
        q_h, dout_h, out_h, lse_h = ([half.contiguous() for half in _halves(t)]
                                     for t in (q, grad_out.to(q.dtype), out, lse[..., None]))
        lse_h = [half[..., 0] for half in lse_h]
        dq = [torch.zeros(half.shape, device=q.device) for half in q_h]
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(2, *q.shape[:2], k.shape[2], q.shape[3], device=q.device)  # expanded heads, fp32
        for step in range(cp_size):
            coming = _Shift(kv, group) if step < cp_size - 1 else None
            keys, values = ([half.contiguous() for half in _halves(_expand(t, heads))] for t in kv)
            dk, dv = (list(_halves(g)) for g in dkv)
            for pair in _pairs(cp_size, cp_rank, (cp_rank - step) % cp_size, causal, visible, chunk):
                i, j = pair.i, pair.j
                grads = _block_backward(dout_h[i], q_h[i], keys[j], values[j], out_h[i], lse_h[i], pair,
                                        _block_mask(dropout_mask, pair.q_id, pair.kv_id, chunk))
                dq[i], dk[j], dv[j] = dq[i] + grads[0], dk[j] + grads[1], dv[j] + grads[2]
            dkv = _Shift(torch.stack([torch.cat(dk, dim=2), torch.cat(dv, dim=2)]), group).result()  # on with its block
            if coming is not None:
                kv = coming.result()
        # after CP hops every block's gradient is back with its block's owner
        grad_k, grad_v = (_fold(g, kv_heads).to(k.dtype) for g in dkv)
        return torch.cat(dq, dim=2).to(q.dtype), grad_k, grad_v, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, causal: bool = True,
                   dropout_mask: torch.Tensor | None = None, visible: Visible = NOTHING_HIDDEN) -> torch.Tensor:
    """Attention of this rank's queries over every rank's keys and values ([batch, heads, tokens
    here, d], q's dtype), the probabilities multiplied by `dropout_mask`'s blocks where given,
    each query seeing the keys `visible` leaves it (and the causal mask, where causal)."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention holds two chunks per rank: {q.shape[2]} tokens here is odd")
    return _RingAttention.apply(q, k, v, group, causal, dropout_mask, visible)
