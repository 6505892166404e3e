"""Point-to-point exchange of activations and their gradients between neighbouring stages.

Every message is a small shape header followed by the tensor, so the receiver needs no prior
knowledge of the shape; with a shape cache (StageLinks' `shapes`, which the engine keeps across
steps), a message whose shape both sides have seen for the same micro-batch input shapes goes
without its header, saving a round trip per exchange. Each step posts its operations with
`batch_isend_irecv`: the headers in one batch, then the tensors in the next. On NCCL a batch is one
group, in which a send and a receive between the same two ranks progress together. Outside a group,
NCCL's sends between a pair share a stream, and a send blocks until the peer's matching receive
runs: two neighbours that each queued send-then-receive (1F1B's steady state) would wait on each
other once an activation outgrows NCCL's buffering. The 1F1B schedule exchanges symmetrically on
each link (when one neighbour sends an output and receives a gradient, the other sends that
gradient and receives the next output), so both sides post the same header batch and then the same
tensor batch.

gloo's sends never block, which hides such a dependence. Strict mode (MEGAZERO_P2P_STRICT=1, or
`set_strict(True)`) shows it on gloo: a send is posted only once the peer has posted the matching
receive (a flag per message through the default process group's store), so an exchange that relies
on a send completing before the peer's receive is posted fails with an error naming both ranks,
instead of passing on gloo and hanging on NCCL.

Sends do not block compute: a send's works are kept (with its tensor, which must not be reused
until then) in StageLinks.pending, and the schedule goes on computing while the message travels;
`flush()`, at the end of every schedule, waits all of them, and surfaces a failed or timed-out
send as an error naming both ranks (a completed send is checked, and dropped, whenever the link
posts more). Receives can be waited late as well: `exchange(..., wait=False)` returns `Incoming`
handles, which the interleaved schedule waits right before the forward or backward that uses them
(the gradient for the next backward arrives while the next forward computes). What is posted, and
in which order, is what it was with every operation waited at once: deferring a wait never makes
one rank wait on another where it did not before, so the ordering arguments above still hold.
On NCCL a wait only orders the compute stream after the communication, so there the gain is that
compute is not ordered after sends it does not need.

Transport (`choose_transport`, the one place it is decided): a link between two ranks on one host
with CPU tensors goes through shared memory (`megazero.pipeline.shm_link`: the main threads copy
the bytes, the receiver sleeps in poll() on a FIFO), not through gloo, whose one tcp loop thread
per process must get a core for every message (on 2 busy cores 10-40% of gloo exchanges stalled
2-5 ms). Such a message carries its shape and dtype in its descriptor, so it has no header batch;
the shape cache's check still applies, and strict mode still makes each send wait for the peer's
receive to be posted (the same store flags). GPU tensors and peers on other hosts keep the
backend (gloo or NCCL). `pipeline.p2p_transport` (or $MEGAZERO_P2P_TRANSPORT, which overrides it):
"auto" (that choice), "backend" (always the process group), "shm" (required: an error for a link
that cannot use it).
"""

from __future__ import annotations

import datetime
import os
import warnings
from collections import Counter

import torch
import torch.distributed as dist

from megazero.pipeline import shm_link
from megazero.watchdog import watched

_MAX_DIMS = 8
_ACTIVATION, _GRADIENT = 0, 1  # message tags of StageLinks.exchange
STRICT_ENV = "MEGAZERO_P2P_STRICT"
STRICT_TIMEOUT_ENV = "MEGAZERO_P2P_STRICT_TIMEOUT"  # seconds a strict send waits for its receive (default 60)
_strict_override: bool | None = None
TRANSPORT_ENV = "MEGAZERO_P2P_TRANSPORT"  # overrides pipeline.p2p_transport
TRANSPORTS = ("auto", "backend", "shm")


def _transport_setting(setting: str | None) -> tuple[str, str]:
    """The transport asked for, and where it was asked: $MEGAZERO_P2P_TRANSPORT, else `setting`."""
    source = TRANSPORT_ENV if os.environ.get(TRANSPORT_ENV) else "pipeline.p2p_transport"
    value = os.environ.get(TRANSPORT_ENV) or setting or "auto"
    if value not in TRANSPORTS:
        raise ValueError(f"{source}: expected one of {', '.join(TRANSPORTS)}, got {value!r}")
    return value, source


def choose_transport(setting: str | None, device: torch.device, me: int, peer: int) -> str:
    """"shm" or "backend" for the link between global ranks `me` and `peer`: $MEGAZERO_P2P_TRANSPORT
    if set, else `setting` (pipeline.p2p_transport; None: "auto"). auto: shm when the tensors are
    on CPU and the peer is on this host (both ends decide alike: the device is the run's, the host
    test symmetric); shm: that, or an error naming the ranks."""
    value, source = _transport_setting(setting)
    if value == "backend":
        return value
    if device.type != "cpu":
        if value == "shm":
            raise ValueError(f"{source} = 'shm' needs CPU tensors; rank {me}'s link to rank {peer} carries "
                             f"{device.type} tensors (use 'auto' or 'backend')")
        return "backend"
    if not shm_link.same_host(peer):
        if value == "shm":
            raise ValueError(f"{source} = 'shm': rank {peer} is not on rank {me}'s host ({shm_link.host_id()})")
        return "backend"
    return "shm"


def set_strict(enabled: bool | None) -> None:
    """Turn strict mode on or off for this process (None: follow $MEGAZERO_P2P_STRICT again)."""
    global _strict_override
    _strict_override = enabled


def strict_mode() -> bool:
    """Whether sends wait for the peer's receive to be posted (see the module docstring)."""
    if _strict_override is not None:
        return _strict_override
    return os.environ.get(STRICT_ENV, "") == "1"


class _ReceivePostedFlags:
    """Strict mode's handshake: message n from src to dst (global ranks) may be sent once dst has
    posted its receive, which dst announces by setting a store key. Both sides count the messages
    of each direction (a pair's messages are matched in order), so the keys agree; the sender
    deletes each key it consumed."""

    def __init__(self):
        self.store = None
        self.sent: Counter = Counter()
        self.received: Counter = Counter()

    def _current_store(self):
        store = dist.distributed_c10d._get_default_store()
        if store is not self.store:  # a new process group: its messages are counted afresh
            self.store, self.sent, self.received = store, Counter(), Counter()
        return store

    @staticmethod
    def _key(src: int, dst: int, n: int) -> str:
        return f"megazero/p2p-strict/{src}->{dst}/{n}"

    def receive_posted(self, src: int, dst: int) -> None:
        """dst has posted its receive of src's next message."""
        store = self._current_store()
        n = self.received[(src, dst)]
        self.received[(src, dst)] += 1
        store.set(self._key(src, dst, n), "1")

    def wait_for_receive(self, src: int, dst: int) -> None:
        """Block until dst has posted its receive of src's next message."""
        store = self._current_store()
        n = self.sent[(src, dst)]
        key = self._key(src, dst, n)
        seconds = float(os.environ.get(STRICT_TIMEOUT_ENV, "60"))
        try:
            store.wait([key], datetime.timedelta(seconds=seconds))
        except RuntimeError as e:
            raise RuntimeError(
                f"strict p2p: rank {src}'s message {n} to rank {dst} waited {seconds:g}s for rank {dst} to "
                f"post its receive: this exchange needs a send to complete before the peer's receive is "
                f"posted, which deadlocks on NCCL") from e
        self.sent[(src, dst)] += 1  # only once sent: a refused send leaves the counts in step
        store.delete_key(key)


_FLAGS = _ReceivePostedFlags()


def post(ops: list[dist.P2POp]) -> list:
    """Post one batch of sends and receives; returns their works (wait on all of them).

    Normally `batch_isend_irecv` (one NCCL group). In strict mode the receives are posted first
    and announced, then each send waits until its peer has announced the matching receive."""
    if not strict_mode():
        return dist.batch_isend_irecv(ops)
    me = dist.get_rank()
    works = []
    for op in ops:
        if op.op is dist.irecv:
            works.append(dist.irecv(op.tensor, op.peer, group=op.group, tag=op.tag))
            _FLAGS.receive_posted(op.peer, me)
    for op in ops:
        if op.op is dist.isend:
            _FLAGS.wait_for_receive(me, op.peer)
            works.append(dist.isend(op.tensor, op.peer, group=op.group, tag=op.tag))
    return works


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class Incoming:
    """A posted receive: `wait()` returns the tensor once it has arrived (a leaf that will receive
    a gradient when it is an activation). Waiting where the tensor is first used, rather than
    where it was posted, lets the message travel while this rank computes."""

    def __init__(self, links: StageLinks, works: list, tensor: torch.Tensor, activation: bool):
        self._links, self._works, self._tensor, self._activation = links, works, tensor, activation

    def wait(self) -> torch.Tensor:
        """The received tensor (waits for it on the first call)."""
        if self._works is not None:
            works, self._works = self._works, None
            self._links._timed(_wait, works)
            if self._activation:
                self._tensor.requires_grad_()
        return self._tensor


class _ShmIncoming(Incoming):
    """A receive posted on a shared-memory channel: message `number` of `tag` from its peer."""

    def __init__(self, links: StageLinks, channel: shm_link.Channel, tag: int):
        super().__init__(links, None, None, tag == _ACTIVATION)
        self._channel, self._tag, self._number = channel, tag, channel.expect(tag)

    def wait(self) -> torch.Tensor:
        """The received tensor (waits for it on the first call)."""
        if self._tensor is None:
            channel, tag, number = self._channel, self._tag, self._number
            what = f"receive of {'an activation' if self._activation else 'a gradient'} from"
            self._links._timed(shm_link.progress, self._links.channels, lambda: channel.has(tag, number), what,
                               channel.peer)
            tensor = channel.take(tag, number)
            if tensor.dtype != self._links.dtype:
                raise RuntimeError(f"pipeline p2p: rank {self._links.me} received a {tensor.dtype} tensor from rank "
                                   f"{channel.peer}, expected {self._links.dtype}")
            self._tensor = tensor.requires_grad_() if self._activation else tensor
        return self._tensor


def resolve(value):
    """`value`, or the tensor of an Incoming (waited for now)."""
    return value.wait() if isinstance(value, Incoming) else value


def input_shapes(batches: list) -> tuple | None:
    """The shapes and dtypes of a schedule's micro-batches (mappings or sequences of tensors), when
    they are all the same (a StageLinks shape_key: a stage's output shape follows from them); else
    None (every message then carries its header)."""

    def of(batch) -> tuple:
        items = sorted(batch.items()) if isinstance(batch, dict) else enumerate(batch)
        return tuple((k, tuple(v.shape), str(v.dtype)) for k, v in items if isinstance(v, torch.Tensor))

    keys = {of(batch) for batch in batches}
    return keys.pop() if len(keys) == 1 else None


class StageLinks:
    """This rank's previous and next stage (global ranks) in its pipeline, and the tensor dtype/device.

    shapes: where to remember the messages' shapes, so that later messages travel without their
    headers (one round trip per exchange instead of two): a dict that outlives one schedule, and
    shape_key, what identifies messages of one shape (the engine's: the micro-batch's input
    shapes; None: every message carries its header). A message's key is (activation or gradient,
    source, destination, shape_key); the sender records it when it sends the header, the receiver
    when it receives it, so both sides agree on which messages come without one.
    """

    def __init__(self, pp_ranks: list[int], pp_rank: int, group, dtype: torch.dtype, device: torch.device,
                 timers=None, ring: bool = False, shapes: dict | None = None, shape_key=None,
                 transport: str | None = None):
        size = len(pp_ranks)
        # ring (the interleaved schedule): the last stage's next is the first, whose previous is the last
        self.prev = pp_ranks[(pp_rank - 1) % size] if pp_rank > 0 or ring else None
        self.next = pp_ranks[(pp_rank + 1) % size] if pp_rank + 1 < size or ring else None
        self.me = pp_ranks[pp_rank]
        self.group, self.dtype, self.device = group, dtype, device
        self.timer = timers("pipe_send_recv") if timers is not None else None  # time spent exchanging
        self.shapes = shapes if shape_key is not None else None
        self.shape_key = shape_key
        # sends posted and not yet known complete: (works, tensor kept alive for them, what, peer)
        self.pending: list[tuple[list, torch.Tensor, str, int]] = []
        self._timing = False
        # peers reached through shared memory (choose_transport); set up in rank order, which
        # cannot deadlock (every rank takes its pairs in one global order)
        peers = sorted({p for p in (self.prev, self.next) if p is not None})
        self.shm = {}
        for peer in peers:
            if choose_transport(transport, device, self.me, peer) != "shm":
                continue
            try:
                self.shm[peer] = shm_link.channel(group, peer)
            except shm_link.ShmUnavailable as e:
                if _transport_setting(transport)[0] == "shm":
                    raise
                warnings.warn(f"{e}; rank {self.me}'s link to rank {peer} goes through the process group",
                              stacklevel=2)
        self.channels = list(self.shm.values())

    def _timed(self, fn, *args):
        if self.timer is None or self._timing:  # a wait inside a timed exchange is timed already
            return fn(*args)
        self._timing = True
        self.timer.start()
        try:
            return fn(*args)
        finally:
            self.timer.stop()
            self._timing = False

    def _header(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"pipeline messages support up to {_MAX_DIMS} dimensions, got {tensor.dim()}")
        values = [tensor.dim(), *tensor.shape] + [0] * (_MAX_DIMS - tensor.dim())
        return torch.tensor(values, dtype=torch.int64).to(self.device)  # one host-to-device copy

    def _empty_header(self) -> torch.Tensor:
        return torch.empty(_MAX_DIMS + 1, dtype=torch.int64, device=self.device)

    @staticmethod
    def _shape_of(header: torch.Tensor) -> tuple[int, ...]:
        values = header.tolist()  # one device-to-host copy: the shape decides the allocation
        return tuple(values[1:1 + values[0]])

    def _cached(self, tag: int, src: int, dst: int):
        """(key, remembered shape or None); key None when shapes are not remembered."""
        if self.shapes is None:
            return None, None
        key = (tag, src, dst, self.shape_key)
        return key, self.shapes.get(key)

    def _keep(self, works: list, tensor: torch.Tensor, what: str, peer: int) -> None:
        """Keep a posted send until it is known complete (flush, or a later post's check)."""
        self.pending.append((works, tensor, what, peer))

    def _send_failed(self, what: str, peer: int, error: Exception) -> RuntimeError:
        return RuntimeError(f"pipeline p2p: rank {self.me}'s send of {what} to rank {peer} failed: {error}")

    def _drop_completed(self) -> None:
        """Forget the pending sends that have completed (raising a failed one's error), so that
        the list stays short and an error shows at the next post, not only at the flush. Shared
        memory channels push their queued sends and copy out what has arrived (neither waits)."""
        for channel in self.channels:
            channel.push()
            channel.drain()
        kept = []
        for entry in self.pending:
            works, _, what, peer = entry
            if all(work.is_completed() for work in works):
                try:
                    _wait(works)  # returns at once; raises the error of a failed send
                except RuntimeError as e:
                    raise self._send_failed(what, peer, e) from e
            else:
                kept.append(entry)
        self.pending = kept

    def _post(self, sends: list[tuple[torch.Tensor, int, int, str]],
              recvs: list[tuple[torch.Tensor, int, int]]) -> list:
        """Post one batch: each send (tensor, peer, tag, what) is kept pending, not waited; returns
        the works to wait for the receives (tensor, peer, tag), in their order. On NCCL a batch is
        one coalesced work (the sends' too: waiting it orders the stream after the whole batch)."""
        ops = ([dist.P2POp(dist.isend, t, peer, self.group, tag) for t, peer, tag, _ in sends]
               + [dist.P2POp(dist.irecv, t, peer, self.group, tag) for t, peer, tag in recvs])
        if not ops:
            return []
        works = post(ops)
        if strict_mode():  # post() gives the receives' works first
            works = works[len(recvs):] + works[:len(recvs)]
        if len(works) != len(ops):  # coalesced: one work (or a few) for the whole batch
            for tensor, peer, _, what in sends:
                self._keep(works, tensor, what, peer)
            return [works] * len(recvs)
        for (tensor, peer, _, what), work in zip(sends, works):
            self._keep([work], tensor, what, peer)
        return [[work] for work in works[len(sends):]]

    def _transfer(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[int, int]]) -> list[Incoming]:
        """Send each (tensor, peer, tag) and receive one tensor per (peer, tag): the headers not
        remembered in one batch, then the tensors in the next. Activations travel under one tag
        and gradients under another: on 2 stages in a ring the previous and the next stage are one
        rank, whose two messages must not be confused. Both sides list a step's messages in the
        same order (activations, then gradients), so strict mode's per-pair counts agree.

        Only the received headers are waited here (they size the tensors to receive); the sends
        stay pending (flush) and the tensors' receives are returned as Incoming handles. A pair's
        messages of one tag arrive in the order they were posted, so a header or tensor still in
        flight from an earlier step is matched before this step's. Peers on shared memory: see
        _transfer_shm."""
        self._drop_completed()
        incoming = self._transfer_shm([s for s in sends if s[1] in self.shm], [r for r in recvs if r[0] in self.shm])
        sends = [s for s in sends if s[1] not in self.shm]
        backend = iter(self._transfer_backend(sends, [r for r in recvs if r[0] not in self.shm]))
        return [next(incoming) if peer in self.shm else next(backend) for peer, _ in recvs]

    def _needs_header(self, tensor: torch.Tensor, peer: int, tag: int) -> bool:
        """Whether a send must carry its shape header (and records the shape when it does)."""
        key, shape = self._cached(tag, self.me, peer)
        if shape is None:
            if key is not None:
                self.shapes[key] = tuple(tensor.shape)
            return True
        if shape != tuple(tensor.shape):
            raise RuntimeError(f"pipeline p2p: rank {self.me} sends rank {peer} a tensor of shape "
                               f"{tuple(tensor.shape)} where an earlier message for the same input shapes had "
                               f"{shape}: a stage's output shape must follow from its micro-batch's shapes")
        return False

    def _transfer_shm(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[int, int]]):
        """_transfer's messages to peers on shared memory: each send copied into the channel (or
        queued there) at once, each receive an Incoming; strict mode's flags as in post()."""
        incoming = [_ShmIncoming(self, self.shm[peer], tag) for peer, tag in recvs]
        if strict_mode():
            for peer, _ in recvs:
                _FLAGS.receive_posted(peer, self.me)
        for tensor, peer, tag in sends:
            self._needs_header(tensor, peer, tag)  # no header travels; the shape check still holds
            if strict_mode():
                _FLAGS.wait_for_receive(self.me, peer)
            self.shm[peer].send(tensor, tag)
        return iter(incoming)

    def _transfer_backend(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[int, int]]):
        """_transfer's messages through the process group: header batch, then tensor batch."""
        header_sends, header_recvs = [], []
        for tensor, peer, tag in sends:
            if self._needs_header(tensor, peer, tag):
                header_sends.append((self._header(tensor), peer, tag, "a shape header"))
        shapes, headers = [], []
        for peer, tag in recvs:
            key, shape = self._cached(tag, peer, self.me)
            shapes.append(shape)
            if shape is None:
                header = self._empty_header()
                headers.append((len(shapes) - 1, key, header))
                header_recvs.append((header, peer, tag))
        for works in self._post(header_sends, header_recvs):
            _wait(works)
        for index, key, header in headers:
            shapes[index] = self._shape_of(header)
            if key is not None:
                self.shapes[key] = shapes[index]
        received = [torch.empty(shape, dtype=self.dtype, device=self.device) for shape in shapes]
        what = {_ACTIVATION: "an activation", _GRADIENT: "a gradient"}
        works = self._post([(t, peer, tag, what[tag]) for t, peer, tag in sends],
                           [(r, peer, tag) for r, (peer, tag) in zip(received, recvs)])
        return [Incoming(self, w, r, tag == _ACTIVATION) for w, r, (_, tag) in zip(works, received, recvs)]

    @watched("p2p flush (this stage's pending sends)")
    def flush(self, timeout: datetime.timedelta | None = None) -> None:
        """Wait every pending send (the end of a schedule: its tensors may then be freed). A send
        that failed, or is not complete within `timeout` (default: the process group's), raises
        an error naming both ranks; the sends not yet known complete then stay pending (their
        tensors alive), so the link is not left sending from freed memory."""
        def wait_all() -> None:
            while self.pending:
                works, _, what, peer = self.pending[0]
                try:
                    for work in works:
                        work.wait() if timeout is None else work.wait(timeout)
                except RuntimeError as e:
                    raise self._send_failed(what, peer, e) from e
                self.pending.pop(0)
            seconds = None if timeout is None else timeout.total_seconds()
            for channel in self.channels:
                try:
                    shm_link.progress(self.channels, lambda c=channel: not c.queued, "flush of its sends to",
                                      channel.peer, seconds)
                except RuntimeError as e:
                    raise self._send_failed(f"{len(channel.queued)} queued message(s)", channel.peer, e) from e

        self._timed(wait_all)

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self._transfer([(tensor.detach().contiguous(), peer, tag)], [])

    def _recv(self, peer: int, tag: int) -> torch.Tensor:
        return self._transfer([], [(peer, tag)])[0].wait()

    def _exchange(self, tensor: torch.Tensor, peer: int, send_tag: int) -> torch.Tensor:
        """Send `tensor` to `peer` while receiving one from it (the peer does the same exchange,
        mirrored): an activation sent meets a gradient received, and the other way round."""
        recv_tag = _GRADIENT if send_tag == _ACTIVATION else _ACTIVATION
        return self._transfer([(tensor.detach().contiguous(), peer, send_tag)], [(peer, recv_tag)])[0].wait()

    def _exchange_both(self, send_next, send_prev, recv_prev: bool, recv_next: bool, wait: bool):
        sends = [(t.detach().contiguous(), self.next, _ACTIVATION) for t in [send_next] if t is not None]
        sends += [(t.detach().contiguous(), self.prev, _GRADIENT) for t in [send_prev] if t is not None]
        recvs = ([(self.prev, _ACTIVATION)] if recv_prev else []) + ([(self.next, _GRADIENT)] if recv_next else [])
        received = iter(incoming.wait() if wait else incoming for incoming in self._transfer(sends, recvs))
        return next(received) if recv_prev else None, next(received) if recv_next else None

    @watched("p2p exchange with both neighbours")
    def exchange(self, send_next: torch.Tensor | None = None, send_prev: torch.Tensor | None = None,
                 recv_prev: bool = False, recv_next: bool = False, wait: bool = True) -> tuple:
        """One step of the interleaved schedule: send an output to the next stage and/or an input
        gradient to the previous one while receiving an input from the previous stage and/or an
        output gradient from the next (headers of all four in one batch, then the tensors; the
        sends stay pending until flush). Returns (input from prev, a leaf that will receive a
        gradient; gradient from next); wait=False: as Incoming handles, to wait right before use."""
        if send_next is None and send_prev is None and not recv_prev and not recv_next:
            return None, None
        return self._timed(self._exchange_both, send_next, send_prev, recv_prev, recv_next, wait)

    @watched("p2p transfer (a schedule's sends and receives)")
    def transfer(self, sends: list[tuple[torch.Tensor, int, bool]], recvs: list[tuple[int, bool]]) -> list[Incoming]:
        """Send each (tensor, peer, activation: True for an activation, False for a gradient) to
        the previous or next stage (global ranks) and post a receive for each (peer, activation),
        in one exchange; the receives come back as Incoming handles, in `recvs`' order. A pair's
        messages must be received in the order they were sent (NCCL matches them by order alone)."""
        def tag(activation: bool) -> int:
            return _ACTIVATION if activation else _GRADIENT

        return self._timed(self._transfer, [(t.detach().contiguous(), peer, tag(a)) for t, peer, a in sends],
                           [(peer, tag(a)) for peer, a in recvs])

    @watched("p2p recv forward (the previous stage's output)")
    def recv_forward(self) -> torch.Tensor:
        """The previous stage's output (this stage's input), as a leaf that will receive a gradient."""
        return self._timed(self._recv, self.prev, _ACTIVATION).requires_grad_()

    @watched("p2p send forward (to the next stage)")
    def send_forward(self, output: torch.Tensor) -> None:
        """Send this stage's output to the next stage."""
        self._timed(self._send, output, self.next, _ACTIVATION)

    @watched("p2p recv backward (the next stage's gradient)")
    def recv_backward(self) -> torch.Tensor:
        """The gradient of this stage's output, from the next stage."""
        return self._timed(self._recv, self.next, _GRADIENT)

    @watched("p2p send backward (to the previous stage)")
    def send_backward(self, input_grad: torch.Tensor) -> None:
        """Send the gradient of this stage's input to the previous stage."""
        self._timed(self._send, input_grad, self.prev, _GRADIENT)

    @watched("p2p send forward / recv backward (with the next stage)")
    def send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor:
        """Send the output on while receiving the gradient of an earlier output."""
        return self._timed(self._exchange, output, self.next, _ACTIVATION)

    @watched("p2p send backward / recv forward (with the previous stage)")
    def send_backward_recv_forward(self, input_grad: torch.Tensor) -> torch.Tensor:
        """Send an input gradient back while receiving the next input."""
        return self._timed(self._exchange, input_grad, self.prev, _GRADIENT).requires_grad_()
