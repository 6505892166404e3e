"""Running a one-chunk schedule whose backward is split (ZB-H1): 1F1B's order of F and B, with
each rank's W actions where the schedule (megazero.pipeline.actions) puts them.

The messages are 1F1B's, posted in the same batches in the same order on both sides of every link
(megazero.pipeline.schedule says why that matters on NCCL); what changes is when they are waited:
each receive is posted as 1F1B posts it and waited right before the F or B that uses it, and the
W actions that follow an F or a B in the schedule run in between, so a W fills the time the rank
would otherwise wait for its next input or gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megazero.pipeline.actions import Schedule, W, one_f_one_b
from megazero.pipeline.p2p import StageLinks, resolve


def _weights_after(schedule: Schedule, stage: int) -> dict[int, list[int]]:
    """{index among the rank's F and B actions: the micro-batches of the W actions right after it};
    ValueError unless its F and B run in 1F1B's order."""
    order = [a for a in schedule.ranks[stage] if a.kind != W]
    if schedule.num_chunks != 1 or order != one_f_one_b(schedule.num_stages, schedule.num_microbatches).ranks[stage]:
        raise ValueError(f"pipeline schedule {schedule.name!r}: rank {stage}'s forwards and backwards are not in "
                         f"1F1B's order, which this runner's messages follow")
    after: dict[int, list[int]] = {}
    index = -1
    for action in schedule.ranks[stage]:
        if action.kind == W:
            after.setdefault(index, []).append(action.micro)
        else:
            index += 1
    return after


def run_split_one_f_one_b(schedule: Schedule, stage: int, links: StageLinks,
                          forward_step: Callable[[int, torch.Tensor | None], torch.Tensor],
                          backward_step: Callable[[int, torch.Tensor, torch.Tensor | None], None],
                          weight_step: Callable[[int], None]) -> None:
    """Run `schedule` on this stage: forward_step(m, input) -> output, backward_step(m, output,
    output_grad) (the B: input gradients, weight gradients deferred where the schedule has their W),
    weight_step(m) (the W of micro-batch m); as megazero.pipeline.schedule.one_f_one_b otherwise."""
    p, m = schedule.num_stages, schedule.num_microbatches
    first, last = stage == 0, stage == p - 1
    weights = _weights_after(schedule, stage)
    done = [0]  # F and B actions run so far
    in_flight: list[tuple[int, object, torch.Tensor]] = []  # (micro, input or Incoming, output)

    def after_action() -> None:
        for micro in weights.get(done[0], []):
            weight_step(micro)
        done[0] += 1

    def forward(micro: int, received) -> torch.Tensor:
        received = None if received is None else resolve(received)
        output = forward_step(micro, received)
        in_flight.append((micro, received, output))
        return output

    def backward(output_grad) -> torch.Tensor | None:
        micro, received, output = in_flight.pop(0)
        backward_step(micro, output, None if output_grad is None else resolve(output_grad))
        return None if first else received.grad

    def recv_grad():
        return None if last else links.exchange(recv_next=True, wait=False)[1]

    warmup = min(p - stage - 1, m)
    for i in range(warmup):
        output = forward(i, None if first else links.exchange(recv_prev=True, wait=False)[0])
        if not last:
            links.exchange(send_next=output)
        after_action()
    remaining = m - warmup
    received = None if first or remaining == 0 else links.exchange(recv_prev=True, wait=False)[0]
    grads = []  # the cool-down's gradients, each posted one backward ahead
    for i in range(remaining):
        output = forward(warmup + i, received)
        output_grad = None if last else links.exchange(send_next=output, recv_next=True, wait=False)[1]
        after_action()
        input_grad = backward(output_grad)
        if i == remaining - 1:
            if not first:
                links.exchange(send_prev=input_grad)
            if warmup:
                grads.append(recv_grad())
        elif first:
            received = None
        else:
            received = links.exchange(send_prev=input_grad, recv_prev=True, wait=False)[0]
        after_action()
    if remaining == 0 and warmup:
        grads.append(recv_grad())
    for c in range(warmup):
        input_grad = backward(grads.pop(0))
        if not first:
            links.exchange(send_prev=input_grad)
        if c + 1 < warmup:
            grads.append(recv_grad())
        after_action()
    links.flush()
