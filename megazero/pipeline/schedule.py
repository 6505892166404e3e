"""The 1F1B pipeline schedule (PipeDream-flush, Megatron's non-interleaved schedule).

Stage s of p runs min(p - s - 1, m) warm-up forwards, then alternates one forward and one
backward until every forward is done, then the remaining backwards (cool-down). At most p - s
micro-batches' activations are alive at once, and backwards run in micro-batch order, so the
gradient-accumulation boundary is the last backward. The idle fraction of each stage (the
bubble) is (p - 1) / (m + p - 1).

On each link the neighbours' calls mirror each other: stage s's warm-up sends meet stage s + 1's
receives, each send_forward_recv_backward of s meets a send_backward_recv_forward of s + 1, and
the cool-down receives of s meet the sends of s + 1. That is what lets StageLinks post every
exchange as two batches (headers, then tensors) without a send waiting on a receive the peer has
not posted (tests/distributed/test_pipeline_p2p.py runs the schedule in p2p's strict mode).

Sends do not block: each returns once posted, the stage goes on to its next forward or backward
while the message travels, and the schedule ends with StageLinks.flush(), which waits for every
send still pending (and raises a failed one's error).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megazero.pipeline.p2p import StageLinks


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of a 1F1B pipeline with equal stage times: (p - 1) / (m + p - 1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def one_f_one_b(num_microbatches: int, stage: int, num_stages: int, links: StageLinks,
                forward_step: Callable[[int, torch.Tensor | None], torch.Tensor],
                backward_step: Callable[[int, torch.Tensor, torch.Tensor | None], None] | None,
                forward_only: bool = False) -> None:
    """Run the schedule on this stage.

    forward_step(m, input) -> output: runs micro-batch m (input is None on the first stage; the
    output is the loss on the last stage). backward_step(m, output, output_grad) backpropagates it
    (output_grad is None on the last stage, where output is the loss). forward_only (evaluation):
    every micro-batch is a warm-up forward, and there is no backward.
    """
    first, last = stage == 0, stage == num_stages - 1
    warmup = num_microbatches if forward_only else min(num_stages - stage - 1, num_microbatches)
    in_flight: list[tuple[int, torch.Tensor | None, torch.Tensor]] = []  # (m, input, output)

    def run_forward(m: int, received: torch.Tensor | None) -> torch.Tensor:
        output = forward_step(m, received)
        in_flight.append((m, received, output))
        return output

    def run_backward(output_grad: torch.Tensor | None) -> torch.Tensor | None:
        m, received, output = in_flight.pop(0)
        backward_step(m, output, output_grad)
        return None if first else received.grad

    for m in range(warmup):
        output = run_forward(m, None if first else links.recv_forward())
        if not last:
            links.send_forward(output)
    if forward_only:
        links.flush()
        return
    remaining = num_microbatches - warmup
    received = None if first or remaining == 0 else links.recv_forward()
    for i in range(remaining):
        output = run_forward(warmup + i, received)
        output_grad = None if last else links.send_forward_recv_backward(output)
        input_grad = run_backward(output_grad)
        if i == remaining - 1:
            if not first:
                links.send_backward(input_grad)
        elif first:
            received = None
        else:
            received = links.send_backward_recv_forward(input_grad)
    for _ in range(warmup):
        input_grad = run_backward(None if last else links.recv_backward())
        if not first:
            links.send_backward(input_grad)
    links.flush()  # every send complete: the tensors they read may be freed
