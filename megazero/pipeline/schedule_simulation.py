"""The interleaved 1F1B schedule's step time for given per-virtual-stage costs, simulated from the
schedule's own order of operations.

The order is recorded by running megazero.pipeline.interleaved.interleaved_one_f_one_b itself on
every stage with a recording link (no tensors, no processes): each forward, backward and exchange
in the order the schedule issues them, and for each message which virtual stage's forward output
or input gradient of which micro-batch it carries (known once the forward or backward that uses
it runs). The timing then follows what the schedule does on a real link: a stage runs its
operations in order; an exchange posts its sends and receives and goes on (sends do not block,
receives are waited where first used); a forward or backward that needs a message starts once
the message has arrived, `latency` after both its send and its receive are posted. So what a
stage waits for is the peer's compute up to the exchange that sends it (in the steady state a
forward's output goes out right after that forward, an input gradient right after its backward),
which is what a split of the layers over the virtual stages changes, and what a per-rank total
does not show.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megazero.pipeline.interleaved import interleaved_one_f_one_b

ACTIVATION, GRADIENT = "activation", "gradient"


@dataclass
class _Token:
    """A message a stage sends (key known when made) or receives (key set by the forward or
    backward that uses it). key: (kind, virtual stage that sends it, micro-batch)."""
    key: tuple | None = None
    grad: _Token | None = None  # on a received activation: the input gradient its backward sends back


@dataclass
class _Op:
    kind: str  # "forward", "backward" or "exchange"
    virtual: int = -1
    micro: int = -1
    needs: _Token | None = None  # the received message the compute uses
    sends: list[_Token] = field(default_factory=list)
    receives: list[_Token] = field(default_factory=list)


class _RecordingLinks:
    """Stands in for StageLinks: records the exchanges the schedule posts."""

    def __init__(self, ops: list[_Op]):
        self.ops = ops

    def exchange(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False, wait=True):
        op = _Op("exchange", sends=[t for t in (send_next, send_prev) if t is not None])
        received = [_Token() if wanted else None for wanted in (recv_prev, recv_next)]
        op.receives = [t for t in received if t is not None]
        if op.sends or op.receives:
            self.ops.append(op)
        return tuple(received)

    def flush(self) -> None:
        pass


def schedule_ops(num_microbatches: int, stage: int, num_stages: int, num_chunks: int) -> list[_Op]:
    """Stage `stage`'s operations in the order interleaved_one_f_one_b issues them (training: each
    forward, backward and exchange, with the messages' keys filled in)."""
    p, ops = num_stages, []
    last_virtual = num_stages * num_chunks - 1

    def forward_step(chunk: int, micro: int, received: _Token | None) -> _Token:
        virtual = chunk * p + stage
        if received is not None:
            received.key = (ACTIVATION, virtual - 1, micro)
            received.grad = _Token((GRADIENT, virtual, micro))
        ops.append(_Op("forward", virtual, micro, needs=received))
        return _Token((ACTIVATION, virtual, micro))

    def backward_step(chunk: int, micro: int, output: _Token, output_grad: _Token | None) -> None:
        virtual = chunk * p + stage
        if output_grad is not None:
            output_grad.key = (GRADIENT, virtual + 1, micro)
        elif virtual != last_virtual:
            raise AssertionError(f"virtual stage {virtual} ran a backward without an output gradient")
        ops.append(_Op("backward", virtual, micro, needs=output_grad))

    interleaved_one_f_one_b(num_microbatches, stage, num_stages, num_chunks, _RecordingLinks(ops),
                            forward_step, backward_step)
    return ops


@dataclass
class SimulatedStep:
    """The simulated schedule: its makespan and each stage's compute (busy) time in it."""
    makespan: float
    busy: list[float]

    @property
    def idle_fraction(self) -> list[float]:
        """Each stage's idle time over the makespan (the bubble the benchmark measures)."""
        return [1 - b / self.makespan for b in self.busy]


_ORDERS: dict[tuple[int, int, int], list[list[_Op]]] = {}  # the recorded orders, per (m, p, v)


def simulate_interleaved(num_microbatches: int, num_stages: int, num_chunks: int, forward_costs: list[float],
                         backward_costs: list[float], latency: float = 0.0) -> SimulatedStep:
    """The interleaved schedule's step with virtual stage k's forward costing forward_costs[k] and
    its backward backward_costs[k] (k = chunk c * p + stage s; p * v of each); a message arrives
    `latency` after both its send and its receive are posted (see the module docstring)."""
    p, v, m = num_stages, num_chunks, num_microbatches
    if len(forward_costs) != p * v or len(backward_costs) != p * v:
        raise ValueError(f"simulate_interleaved: expected {p * v} forward and backward costs (p={p} x v={v}), "
                         f"got {len(forward_costs)} and {len(backward_costs)}")
    if (m, p, v) not in _ORDERS:
        _ORDERS[(m, p, v)] = [schedule_ops(m, s, p, v) for s in range(p)]
    orders = _ORDERS[(m, p, v)]
    posted_send: dict[tuple, float] = {}
    posted_receive: dict[tuple, float] = {}
    clock, busy, position = [0.0] * p, [0.0] * p, [0] * p
    while any(position[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(orders[s]):
                op = orders[s][position[s]]
                if op.kind == "exchange":
                    for token in op.sends:
                        posted_send[token.key] = clock[s]
                    for token in op.receives:
                        posted_receive[token.key] = clock[s]
                else:
                    start = clock[s]
                    if op.needs is not None:
                        if op.needs.key not in posted_send:
                            break  # the peer has not got there yet: run the others first
                        arrival = max(posted_send[op.needs.key], posted_receive[op.needs.key]) + latency
                        start = max(start, arrival)
                    cost = (forward_costs if op.kind == "forward" else backward_costs)[op.virtual]
                    clock[s], busy[s] = start + cost, busy[s] + cost
                position[s] += 1
                progressed = True
        if not progressed:
            raise AssertionError(f"simulated interleaved schedule (m={m}, p={p}, v={v}) deadlocked at "
                                 f"operations {position}")
    return SimulatedStep(max(clock), busy)


__all__ = ["SimulatedStep", "schedule_ops", "simulate_interleaved"]
