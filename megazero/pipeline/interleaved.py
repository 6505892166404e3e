"""The interleaved 1F1B schedule (Megatron's, Narayanan et al. 2021): v model chunks per stage.

Each of the p stages holds v model chunks; chunk c of stage s is virtual stage c * p + s, so an
activation goes round the ring of stages v times (stage p - 1's chunk c feeds stage 0's chunk
c + 1). The m micro-batches run in groups of p: virtual micro-batch k of a stage is micro-batch
(k // (p v)) p + k % p on chunk (k % (p v)) // p (backwards take the chunks in reverse order).
Stage s runs (p - s - 1) 2 + (v - 1) p warm-up forwards (at most m v; all of them when m == p),
then alternates one forward and one backward, then the remaining backwards. The bubble is
divided by v: (p - 1) / (v m) of the ideal step time, for v times the messages.

Every warm-up and cool-down step is one exchange with both neighbours (StageLinks.exchange: a
send to the next stage and/or the previous one, a receive from either); a steady-state step is
two, as in Megatron's overlap_p2p_comm: the forward's output goes to the next stage (and the next
input is received) right after the forward, the input gradient to the previous stage (and the
next output gradient received) right after the backward. Sending the output only with the
backward's gradient made the next stage's next forward wait for this stage's backward as well
(benchmarks/bench_parallel.py --bubbles 2, m=16, v=2: 0.098 of the step blocked in p2p before,
0.073 after, theory 0.030). On each link the activations and the gradients each travel in
the order both sides post them, so the strict p2p mode of megazero.pipeline.p2p (sends posted
only once the peer's receive is) runs it as well (tests/distributed/test_pipeline_p2p.py, 4
stages).

Communication overlaps compute: an exchange's sends stay pending until the flush at the end of
the schedule, and what it receives is kept as an Incoming handle, waited only when the forward or
backward that needs it starts; in the steady state the gradient for the next backward arrives
while the next forward computes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megazero.pipeline.p2p import StageLinks, resolve


def interleaved_bubble_fraction(num_stages: int, num_microbatches: int, num_chunks: int) -> float:
    """The interleaved schedule's idle time over its ideal time: (p - 1) / (v m) (Narayanan et al.)."""
    return (num_stages - 1) / (num_chunks * num_microbatches)


def check_interleaving(num_microbatches: int, num_stages: int, num_chunks: int) -> None:
    """Megatron's condition: the micro-batches run in groups of p, so m must be a multiple of p."""
    if num_chunks > 1 and num_microbatches % num_stages:
        raise ValueError(f"the interleaved pipeline schedule needs the number of micro-batches "
                         f"(gradient_accumulation_steps = {num_microbatches}) to be a multiple of the "
                         f"pipeline-parallel size {num_stages} (with {num_chunks} model chunks per stage)")


def warmup_count(num_microbatches: int, stage: int, num_stages: int, num_chunks: int,
                 forward_only: bool = False) -> int:
    """Forwards stage `stage` runs before its first backward (Megatron's count; all of them when
    forward_only)."""
    total = num_microbatches * num_chunks
    if forward_only or num_microbatches == num_stages:
        return total
    return min((num_stages - stage - 1) * 2 + (num_chunks - 1) * num_stages, total)


def interleaved_one_f_one_b(num_microbatches: int, stage: int, num_stages: int, num_chunks: int,
                            links: StageLinks,
                            forward_step: Callable[[int, int, torch.Tensor | None], torch.Tensor],
                            backward_step: Callable[[int, int, torch.Tensor, torch.Tensor | None], None] | None,
                            forward_only: bool = False) -> None:
    """Run the interleaved schedule on this stage (links: a ring, StageLinks(..., ring=True)).

    forward_step(chunk, m, input) -> output: runs micro-batch m through model chunk `chunk` (input
    is None on virtual stage 0; the output is the loss on the last virtual stage).
    backward_step(chunk, m, output, output_grad) backpropagates it (output_grad None where output
    is the loss). Backwards of each chunk run in micro-batch order; the last is chunk 0's of m - 1.
    forward_only (evaluation): every virtual micro-batch is a warm-up forward, no backward; fewer
    micro-batches than stages then run as one group (an evaluation batch is m = 1).
    """
    p, v, m = num_stages, num_chunks, num_microbatches
    if not (forward_only and m < p):
        check_interleaving(m, p, v)
    group = min(p, m)  # micro-batches per group: p, or m < p forward only
    total = m * v
    warmup = warmup_count(m, stage, p, v, forward_only)
    first_rank, last_rank = stage == 0, stage == p - 1

    def chunk_of(k: int, forward: bool) -> int:
        c = (k % (group * v)) // group
        return c if forward else v - 1 - c

    def micro_of(k: int) -> int:
        return (k // (group * v)) * group + k % group

    inputs: list[list] = [[] for _ in range(v)]
    outputs: list[list] = [[] for _ in range(v)]
    output_grads: list[list] = [[] for _ in range(v)]

    def run_forward(k: int) -> torch.Tensor | None:
        """Forward k; returns what to send on (None on the last virtual stage)."""
        c = chunk_of(k, True)
        if first_rank and c == 0:
            inputs[c].append(None)
        inputs[c][-1] = resolve(inputs[c][-1])  # received: wait for it now, right before its use
        output = forward_step(c, micro_of(k), inputs[c][-1])
        outputs[c].append(output)
        return None if last_rank and c == v - 1 else output

    def run_backward(k: int) -> torch.Tensor | None:
        """Backward k; returns the input gradient to send back (None on virtual stage 0)."""
        c = chunk_of(k, False)
        if last_rank and c == v - 1:
            output_grads[c].append(None)
        received, output, grad = inputs[c].pop(0), outputs[c].pop(0), resolve(output_grads[c].pop(0))
        backward_step(c, micro_of(k), output, grad)
        return None if first_rank and c == 0 else received.grad

    if not first_rank:
        inputs[0].append(links.exchange(recv_prev=True, wait=False)[0])
    for k in range(warmup):
        output = run_forward(k)
        next_chunk = chunk_of(k + 1, True)
        recv_prev = not (first_rank and next_chunk == 0) and k != total - 1
        if k == warmup - 1 and warmup < total:  # the steady state's first gradient comes with it
            received, grad = links.exchange(send_next=output, recv_prev=recv_prev, recv_next=not last_rank,
                                            wait=False)
            if not last_rank:
                output_grads[v - 1].append(grad)
        elif group < p:  # forward only, m < p: the input to receive may be the output just sent,
            # come round the ring; its header would wait for this send's tensor: send, then receive
            links.exchange(send_next=output)
            received, _ = links.exchange(recv_prev=recv_prev, wait=False)
        else:
            received, _ = links.exchange(send_next=output, recv_prev=recv_prev, wait=False)
        if recv_prev:
            inputs[next_chunk].append(received)
    if forward_only:
        links.flush()
        return

    remaining = total - warmup
    for i in range(remaining):
        forward_k, backward_k = warmup + i, i
        output = run_forward(forward_k)
        # the first stage runs p - 1 virtual micro-batches ahead of the last (and vice versa): which
        # chunk the next received tensor belongs to, and whether one comes at all
        if first_rank:
            next_forward = chunk_of(forward_k - (p - 1), True)
            recv_prev = next_forward != v - 1
            next_forward += 1
        else:
            recv_prev, next_forward = True, chunk_of(forward_k + 1, True)
        if i == remaining - 1:
            recv_prev = False
        # the output leaves now, before this step's backward (Megatron's overlap_p2p_comm), so the
        # next stage's next forward does not wait for that backward as well
        received, _ = links.exchange(send_next=output, recv_prev=recv_prev, wait=False)
        if recv_prev:
            inputs[next_forward].append(received)
        input_grad = run_backward(backward_k)
        if last_rank:
            next_backward = chunk_of(backward_k - (p - 1), False)
            recv_next = next_backward != 0
            next_backward -= 1
        else:
            recv_next, next_backward = True, chunk_of(backward_k + 1, False)
        _, grad = links.exchange(send_prev=input_grad, recv_next=recv_next, wait=False)
        if recv_next:
            output_grads[next_backward].append(grad)

    if remaining == 0 and not last_rank:  # all warm-up (m == p): the first gradient is still to come
        output_grads[v - 1].append(links.exchange(recv_next=True, wait=False)[1])
    for k in range(remaining, total):
        input_grad = run_backward(k)
        next_backward = chunk_of(k + 1, False)
        recv_next = not (last_rank and next_backward == v - 1) and k != total - 1
        _, grad = links.exchange(send_prev=input_grad, recv_next=recv_next, wait=False)
        if recv_next:
            output_grads[next_backward].append(grad)
    links.flush()  # every send complete: the tensors they read may be freed
