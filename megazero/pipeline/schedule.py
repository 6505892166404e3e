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
send still pending (and raises a failed one's error). Each receive is posted where 1F1B posts it
and waited right before the forward or backward that uses it.

A schedule whose F and B run in 1F1B's order with split backwards (ZB-H1,
megazero.pipeline.actions) runs here too (`run_in_1f1b_order`): the same messages, and the W
actions that follow an F or a B run between posting the next receive and waiting for it, so a W
fills the time the rank would otherwise wait.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megazero.pipeline import actions
from megazero.pipeline.actions import Schedule, W
from megazero.pipeline.p2p import StageLinks, resolve


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
    if not forward_only:
        run_in_1f1b_order(actions.one_f_one_b(num_stages, num_microbatches), stage, links, forward_step,
                          backward_step)
        return
    first, last = stage == 0, stage == num_stages - 1
    for m in range(num_microbatches):
        output = forward_step(m, None if first else links.recv_forward())
        if not last:
            links.send_forward(output)
    links.flush()


def in_1f1b_order(schedule: Schedule) -> bool:
    """Whether every rank of `schedule` runs its F and B actions in 1F1B's order (one chunk), the
    messages run_in_1f1b_order posts."""
    if schedule.num_chunks != 1:
        return False
    expected = actions.one_f_one_b(schedule.num_stages, schedule.num_microbatches).ranks
    return all([a for a in order if a.kind != W] == one for order, one in zip(schedule.ranks, expected))


def _weights_after(schedule: Schedule, stage: int) -> dict[int, list[int]]:
    """{index among the rank's F and B actions: the micro-batches of the W actions right after it};
    ValueError unless its F and B run in 1F1B's order."""
    order = [a for a in schedule.ranks[stage] if a.kind != W]
    expected = actions.one_f_one_b(schedule.num_stages, schedule.num_microbatches).ranks[stage]
    if schedule.num_chunks != 1 or order != expected:
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


def run_in_1f1b_order(schedule: Schedule, stage: int, links: StageLinks,
                      forward_step: Callable[[int, torch.Tensor | None], torch.Tensor],
                      backward_step: Callable[[int, torch.Tensor, torch.Tensor | None], None],
                      weight_step: Callable[[int], None] | None = None) -> None:
    """Run `schedule` (its F and B in 1F1B's order) on this stage: forward_step(m, input) -> output,
    backward_step(m, output, output_grad) (output_grad None on the last stage, where output is the
    loss; the weight gradients deferred where the schedule has their W), weight_step(m) (the W of
    micro-batch m, for a schedule that has W actions)."""
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
