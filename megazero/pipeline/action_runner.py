"""Runs a schedule given as data (megazero.pipeline.actions) on one pipeline stage: the rank's F, B
and W actions in order, with the messages its chunk layout implies.

An F of virtual stage v takes v - 1's output and hands its own to v + 1; a B takes v + 1's gradient
and hands its input's gradient to v - 1. Between two chunks of this rank (the turn of the V layout
on the last stage) the tensor is handed over directly; between ranks it goes through StageLinks.

When messages travel is planned once per schedule, in rounds (`exchange_rounds`): in round t every
rank runs its next action if what it needs was sent in an earlier round, and then each pair of
ranks exchanges what their round-t actions produced, both posting that one exchange (each side's
sends and the receives of the other's). A pair's messages are thus posted in matching batches, in
the same order on both sides, the way NCCL pairs them (by order alone, a send waiting for its
receive), and strict p2p mode (megazero.pipeline.p2p) runs it. The rounds fix only which exchange
carries a message: a rank does not wait for its peers' rounds, only for the tensors it uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megazero.pipeline.actions import Action, B, F, InvalidSchedule, Schedule
from megazero.pipeline.p2p import StageLinks, resolve

Message = tuple[bool, int, int]  # (an activation?, the sending virtual stage, micro-batch)


def _received(schedule: Schedule, rank: int, action: Action) -> tuple[int, Message] | None:
    """(source rank, message) `action` needs from another virtual stage, or None."""
    v = schedule.virtual_stage(rank, action.chunk)
    if action.kind == F and v > 0:
        return schedule.place(v - 1)[0], (True, v - 1, action.micro)
    if action.kind == B and v < schedule.num_virtual - 1:
        return schedule.place(v + 1)[0], (False, v + 1, action.micro)
    return None


def _sent(schedule: Schedule, rank: int, action: Action) -> tuple[int, Message] | None:
    """(destination rank, message) `action` hands to another virtual stage, or None."""
    v = schedule.virtual_stage(rank, action.chunk)
    if action.kind == F and v < schedule.num_virtual - 1:
        return schedule.place(v + 1)[0], (True, v, action.micro)
    if action.kind == B and v > 0:
        return schedule.place(v - 1)[0], (False, v, action.micro)
    return None


@dataclass
class Round:
    """A rank's part of one round: its action (None: it waits this round), then the exchange of the
    messages the round's actions produced: its sends (peer stage, message) and its receives."""

    action: Action | None
    sends: list[tuple[int, Message]] = field(default_factory=list)
    receives: list[tuple[int, Message]] = field(default_factory=list)


def exchange_rounds(schedule: Schedule) -> list[list[Round]]:
    """Every rank's rounds of `schedule` (the same plan on every rank); InvalidSchedule when no rank
    can go on."""
    p = schedule.num_stages
    position = [0] * p
    available: set[Message] = set()  # sent in an earlier round (or handed over on the rank)
    rounds: list[list[Round]] = [[] for _ in range(p)]
    while any(position[r] < len(schedule.ranks[r]) for r in range(p)):
        produced = []
        for r in range(p):
            action = schedule.ranks[r][position[r]] if position[r] < len(schedule.ranks[r]) else None
            if action is not None and (needed := _received(schedule, r, action)) is not None \
                    and needed[1] not in available:
                action = None
            rounds[r].append(Round(action))
            if action is None:
                continue
            position[r] += 1
            if (out := _sent(schedule, r, action)) is not None:
                produced.append((r, *out))
        if not any(ranks[-1].action for ranks in rounds):
            stuck = {r: str(schedule.ranks[r][position[r]]) for r in range(p) if position[r] < len(schedule.ranks[r])}
            raise InvalidSchedule(f"{schedule.name} deadlocks: each rank waits for what another has not run "
                                  f"(rank: next action) {stuck}")
        for src, dst, message in produced:
            available.add(message)
            if dst != src:
                rounds[src][-1].sends.append((dst, message))
                rounds[dst][-1].receives.append((src, message))
    return rounds


def run_actions(schedule: Schedule, stage: int, links: StageLinks, pp_ranks: list[int],
                forward_step: Callable[[int, int, torch.Tensor | None], torch.Tensor],
                backward_step: Callable[[int, int, torch.Tensor, torch.Tensor | None], None] | None,
                weight_step: Callable[[int, int], None] | None = None,
                rounds: list[Round] | None = None) -> None:
    """Run rank `stage`'s actions of `schedule` (pp_ranks: the pipeline's global ranks, by stage).
    forward_step(chunk, m, input) -> output (input None on virtual stage 0; the output is the loss on
    the last), backward_step(chunk, m, output, output_grad) (output_grad None where output is the
    loss), weight_step(chunk, m): the W of a split backward. A schedule of forwards alone
    (actions.forward_only) needs neither of the last two. `rounds`: this rank's exchange_rounds
    (planned here when not given)."""
    if rounds is None:
        rounds = exchange_rounds(schedule)[stage]
    posted: dict[Message, object] = {}  # received (or on their way): Incoming handles
    produced: dict[Message, torch.Tensor] = {}  # to send, or to hand to this rank's other chunk
    in_flight: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}  # (chunk, m) -> (input, output)

    def take(message: Message):
        if message in produced:  # from this rank's other chunk: an activation becomes the chunk's leaf
            tensor = produced.pop(message)
            return tensor.detach().requires_grad_() if message[0] else tensor
        return resolve(posted.pop(message))

    for step in rounds:
        action = step.action
        if action is not None and action.kind in (F, B):
            needed = _received(schedule, stage, action)
            received = None if needed is None else take(needed[1])
            key = (action.chunk, action.micro)
            if action.kind == F:
                result = forward_step(action.chunk, action.micro, received)
                if backward_step is not None:
                    in_flight[key] = (received, result)
            else:
                data, output = in_flight.pop(key)
                backward_step(action.chunk, action.micro, output, received)
                result = None if data is None else data.grad
            if (out := _sent(schedule, stage, action)) is not None:
                produced[out[1]] = result
        elif action is not None:
            weight_step(action.chunk, action.micro)
        if step.sends or step.receives:
            sends = [(produced.pop(message), pp_ranks[peer], message[0]) for peer, message in step.sends]
            incoming = links.transfer(sends, [(pp_ranks[peer], message[0]) for peer, message in step.receives])
            posted.update({message: handle for (_, message), handle in zip(step.receives, incoming)})
    links.flush()


__all__ = ["Round", "exchange_rounds", "run_actions"]
