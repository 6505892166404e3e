"""Same-host shared-memory transport for the pipeline's point-to-point messages on CPU.

Why: on gloo every message is moved by gloo's own `gloo_tcp_loop` thread, which on busy cores
must wait for one (on 2 busy cores 10-40% of exchanges stall 2-5 ms, at any message size). Here
the two main threads move the bytes themselves: the sender copies a message into a ring of shared
memory and writes a small descriptor (tag, dtype, shape, where) into a FIFO; the receiver sleeps
in poll() on that FIFO, which the kernel wakes directly, and copies the message out. The pipe's
write and read order the ring's data before the descriptor (a syscall on each side), so no other
barrier is needed.

One channel per pair of ranks and process group, both directions: for each direction a ring file
(`ring_bytes`), a data FIFO (descriptors) and a credit FIFO (the receiver's running count of bytes
it has consumed, so the sender never overwrites what is unread). The lower rank creates the files
in a fresh directory under /dev/shm whose name it publishes in the process group's store; once
both ranks have opened them the directory is removed, so nothing is left behind even if a rank
dies later (the kernel frees the memory when the last mapping goes). The rings' room is checked
and reserved when they are made: where /dev/shm cannot hold them (a default Docker container has
64 MB), both ranks get ShmUnavailable, and StageLinks goes through the process group instead
(with a warning; an error when the transport "shm" was asked for).

Ordering: a direction's descriptors are read in the order written and each message is copied out
as soon as its descriptor is read, then queued under its tag; a receive takes its tag's oldest
message. So a pair's messages of one tag are matched in order per direction, as the backend's are.
A send never waits for its receive: it goes into the ring at once if there is room, else it is
queued and pushed whenever this process is inside any call of this module (every wait services
every channel's queued sends), and `flush()` pushes until none is left. A message larger than
half the ring travels in pieces.

Errors name both ranks: a peer whose process is gone (its FIFO ends are closed: EOF), a wait
longer than `MEGAZERO_P2P_SHM_TIMEOUT` seconds (default 1800, the process group's), a setup that
the peer never joins.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import os
import select
import shutil
import socket
import struct
import tempfile
import time
from collections import deque

import torch
import torch.distributed as dist

RING_BYTES_ENV = "MEGAZERO_P2P_SHM_RING_BYTES"  # bytes of each direction's ring (default 64 MiB)
TIMEOUT_ENV = "MEGAZERO_P2P_SHM_TIMEOUT"  # seconds a receive or flush may wait (default 1800)
_ALIGN = 64
_UNAVAILABLE = "unavailable"  # published instead of a directory when the rings do not fit
_MAX_DIMS = 8
# tag, dtype code, ndim, ring position (absolute), piece bytes, piece offset, total bytes, shape
_DESCRIPTOR = struct.Struct(f"<7q{_MAX_DIMS}q")
_CREDIT = struct.Struct("<q")
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


def _timeout() -> float:
    return float(os.environ.get(TIMEOUT_ENV, "1800"))


def host_id() -> str:
    """What two processes share exactly when they can share memory: hostname and boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


class _Direction:
    """One direction of a channel, as seen by one side: the ring and its two FIFOs."""

    def __init__(self, ring: torch.Tensor, data_fd: int, credit_fd: int):
        self.ring, self.data_fd, self.credit_fd = ring, data_fd, credit_fd
        self.size = ring.numel()


class Channel:
    """Both directions between this rank (`me`) and `peer` (global ranks): see the module docstring."""

    def __init__(self, me: int, peer: int, out: _Direction, into: _Direction):
        self.me, self.peer, self.out, self.into = me, peer, out, into
        self.written = 0  # absolute ring position of the next piece out (bytes, wrap skips included)
        self.freed = 0  # the peer's consumed count of the out ring
        self.queued: deque = deque()  # sends not yet (wholly) in the ring: [bytes, tag, dtype, shape, done]
        # tag -> {arrival number: message}: a receive takes the message numbered as it was posted,
        # whatever order the receives are waited in
        self.arrived: dict[int, dict[int, torch.Tensor]] = {}
        self._arrivals: dict[int, int] = {}
        self._expected: dict[int, int] = {}
        self._partial = None  # (tensor, its bytes, tag) of a message arriving in pieces
        self._descriptors = b""
        self._credits = b""
        self.closed = False

    # -- sending --------------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, tag: int) -> None:
        """Queue `tensor` (CPU) for the peer under `tag` and push what fits now; never waits."""
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"pipeline messages support up to {_MAX_DIMS} dimensions, got {tensor.dim()}")
        if tensor.dtype not in _CODE:
            raise TypeError(f"shm p2p: rank {self.me} cannot send a {tensor.dtype} tensor to rank {self.peer}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self.queued.append([data, tag, tensor.dtype, tuple(tensor.shape), 0])
        self.push()

    def _take_credits(self) -> None:
        try:
            self._credits += os.read(self.out.credit_fd, 1 << 12)
        except BlockingIOError:
            return
        whole = len(self._credits) - len(self._credits) % _CREDIT.size
        if whole:
            self.freed = max(self.freed, _CREDIT.unpack_from(self._credits, whole - _CREDIT.size)[0])
            self._credits = self._credits[whole:]

    def push(self) -> None:
        """Move queued sends into the ring while there is room (and the data FIFO takes descriptors)."""
        if not self.queued:
            return
        self._take_credits()
        size, largest = self.out.size, self.out.size // 2
        if self.written == self.freed:
            # all consumed: start again at the ring's head, so that only the pages of the messages in
            # flight are ever touched (tmpfs memory), not the whole ring
            self.written = self.freed = -(-self.written // size) * size
        while self.queued:
            data, tag, dtype, shape, done = entry = self.queued[0]
            n = min(data.numel() - done, largest)
            pos = self.written % size
            start = self.written if pos + n <= size else self.written + size - pos  # wrap: skip the tail
            end = start + -(-n // _ALIGN) * _ALIGN
            if end - self.freed > size:
                return  # no room until the peer consumes more
            at = start % size
            self.out.ring[at:at + n].copy_(data[done:done + n])
            dims = list(shape) + [0] * (_MAX_DIMS - len(shape))
            descriptor = _DESCRIPTOR.pack(tag, _CODE[dtype], len(shape), start, n, done, data.numel(), *dims)
            try:
                os.write(self.out.data_fd, descriptor)  # atomic: shorter than PIPE_BUF
            except BlockingIOError:
                return  # the FIFO is full of descriptors the peer has not read; the copy is redone
            except BrokenPipeError as e:
                self.closed = True
                raise self.gone("send to") from e
            self.written = end
            entry[4] = done + n
            if entry[4] == data.numel():
                self.queued.popleft()

    # -- receiving ------------------------------------------------------------------------------
    def drain(self) -> bool:
        """Copy out every message whose descriptor has arrived; False once the peer has closed."""
        try:
            chunk = os.read(self.into.data_fd, _DESCRIPTOR.size * 256)
        except BlockingIOError:
            return True
        if not chunk:
            self.closed = True
            return False
        self._descriptors += chunk
        whole = len(self._descriptors) - len(self._descriptors) % _DESCRIPTOR.size
        consumed = None
        for offset in range(0, whole, _DESCRIPTOR.size):
            tag, code, ndim, start, n, done, total, *dims = _DESCRIPTOR.unpack_from(self._descriptors, offset)
            if done == 0:
                tensor = torch.empty(dims[:ndim], dtype=_DTYPES[code])
                self._partial = (tensor, tensor.reshape(-1).view(torch.uint8), tag)
            tensor, data, _ = self._partial
            at = start % self.into.size
            data[done:done + n].copy_(self.into.ring[at:at + n])
            consumed = start + -(-n // _ALIGN) * _ALIGN
            if done + n == total:
                number = self._arrivals.get(tag, 0)
                self.arrived.setdefault(tag, {})[number] = tensor
                self._arrivals[tag] = number + 1
                self._partial = None
        self._descriptors = self._descriptors[whole:]
        if consumed is not None:
            try:
                os.write(self.into.credit_fd, _CREDIT.pack(consumed))
            except BrokenPipeError:
                pass  # the peer is gone; a later wait says so
        return True

    def expect(self, tag: int) -> int:
        """Post a receive of the peer's next message under `tag`: its number, for `take`."""
        number = self._expected.get(tag, 0)
        self._expected[tag] = number + 1
        return number

    def has(self, tag: int, number: int) -> bool:
        """Whether message `number` of `tag` has arrived (and not been taken)."""
        return number in self.arrived.get(tag, ())

    def take(self, tag: int, number: int) -> torch.Tensor:
        """The arrived message `number` of `tag` (see `has`)."""
        return self.arrived[tag].pop(number)

    def gone(self, what: str) -> RuntimeError:
        """The error for `what` ("rank ME's {what} rank PEER") once the peer has closed its end."""
        return RuntimeError(f"shm p2p: rank {self.me}'s {what} rank {self.peer} failed: rank {self.peer} has "
                            f"closed its end of the link (its process exited or died)")

    def close(self) -> None:
        """Close the FIFOs (the peer then sees this end gone); the rings go with the last reference."""
        for fd in (self.out.data_fd, self.out.credit_fd, self.into.data_fd, self.into.credit_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.closed = True


def progress(channels: list[Channel], done, what: str, peer: int, timeout: float | None = None) -> None:
    """Service `channels` (push queued sends, copy out arrivals) until done() is true, sleeping in
    poll() between; done() waits on `peer`'s channel. Raises an error naming both ranks once that
    peer has closed its end or after `timeout` seconds (default $MEGAZERO_P2P_SHM_TIMEOUT). `what`
    reads "rank ME's {what} rank PEER"."""
    timeout = _timeout() if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while True:
        for channel in channels:
            if not channel.closed:
                channel.push()
                channel.drain()
        if done():
            return
        waited = next(c for c in channels if c.peer == peer)
        if waited.closed:
            raise waited.gone(what)
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"shm p2p: rank {waited.me}'s {what} rank {peer} timed out after {timeout:g}s "
                               f"({TIMEOUT_ENV} sets the limit)")
        poller = select.poll()
        for channel in channels:
            if not channel.closed:  # a closed FIFO polls as always ready
                poller.register(channel.into.data_fd, select.POLLIN)
                if channel.queued:
                    poller.register(channel.out.credit_fd, select.POLLIN)
        poller.poll(min(left, 1.0) * 1000)


# -- setup ----------------------------------------------------------------------------------------
_channels: dict = {}  # (group name, peer) -> Channel
_unavailable: dict = {}  # (group name, peer) -> the ShmUnavailable both ranks got setting it up
_store_of_channels = None


def _wait_key(store, key: str, me: int, peer: int, what: str, timeout: float) -> bytes:
    try:
        store.wait([key], datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise RuntimeError(f"shm p2p: rank {me} waited {timeout:g}s for rank {peer} to {what} "
                           f"(setting up their shared-memory link)") from e
    return store.get(key)


def _ring_bytes() -> int:
    value = int(os.environ.get(RING_BYTES_ENV, str(64 << 20)))
    if value < 2 * _ALIGN:
        raise ValueError(f"{RING_BYTES_ENV} must be at least {2 * _ALIGN}, got {value}")
    return value // _ALIGN * _ALIGN


class ShmUnavailable(RuntimeError):
    """The lower rank could not make a link's shared memory (too little room in /dev/shm)."""


def _create_files(me: int, peer: int, size: int) -> str:
    """The lower rank's part: a fresh directory with both directions' ring files and FIFOs. The
    rings' room is checked and reserved up front: a ring file past what /dev/shm can hold (64 MB
    in a default Docker container) would be a SIGBUS at first touch, not an error."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = tempfile.mkdtemp(prefix=f"megazero-p2p-{me}-{peer}-", dir=root)
    atexit.register(shutil.rmtree, path, True)  # in case the peer never opens them
    stats = os.statvfs(path)
    free = stats.f_bavail * stats.f_frsize
    try:
        if free < 2 * size:
            raise ShmUnavailable(f"{os.path.dirname(path)} has {free:,} bytes free, the link's two rings need "
                                 f"{2 * size:,} (${RING_BYTES_ENV} sets a ring's bytes)")
        for src, dst in ((me, peer), (peer, me)):
            with open(os.path.join(path, f"ring-{src}-{dst}"), "wb") as f:
                f.truncate(size)
                try:
                    os.posix_fallocate(f.fileno(), 0, size)
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        raise ShmUnavailable(f"{os.path.dirname(path)} ran out of room for a {size:,}-byte ring "
                                             f"(${RING_BYTES_ENV} sets its bytes)") from e
                    # a file system without fallocate: the room was checked above
            os.mkfifo(os.path.join(path, f"data-{src}-{dst}"))
            os.mkfifo(os.path.join(path, f"credit-{src}-{dst}"))
    except ShmUnavailable:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def connect(store, group_name: str, me: int, peer: int, timeout: float | None = None) -> Channel:
    """Set up (both ranks call it) the shared-memory channel between `me` and `peer`."""
    timeout = _timeout() if timeout is None else timeout
    prefix = f"megazero/p2p-shm/{group_name}/{min(me, peer)}-{max(me, peer)}/"
    size = _ring_bytes()
    if me < peer:
        try:
            store.set(prefix + "dir", _create_files(me, peer, size) + f"|{size}")
        except ShmUnavailable as e:
            store.set(prefix + "dir", f"{_UNAVAILABLE}|{e}")  # the peer learns it too
    path, detail = _wait_key(store, prefix + "dir", me, peer, "create the link's files",
                             timeout).decode().split("|", 1)
    if path == _UNAVAILABLE:
        raise ShmUnavailable(f"shm p2p: no shared-memory link between ranks {min(me, peer)} and "
                             f"{max(me, peer)}: {detail}")
    size = int(detail)

    def name(kind: str, src: int, dst: int) -> str:
        return os.path.join(path, f"{kind}-{src}-{dst}")

    try:
        # read ends first (opening a FIFO to write needs a reader), then the write ends
        data_in = os.open(name("data", peer, me), os.O_RDONLY | os.O_NONBLOCK)
        credit_in = os.open(name("credit", me, peer), os.O_RDONLY | os.O_NONBLOCK)
        store.set(prefix + f"read/{me}", "1")
        _wait_key(store, prefix + f"read/{peer}", me, peer, "open its ends of the link", timeout)
        data_out = os.open(name("data", me, peer), os.O_WRONLY | os.O_NONBLOCK)
        credit_out = os.open(name("credit", peer, me), os.O_WRONLY | os.O_NONBLOCK)
        ring_out = torch.from_file(name("ring", me, peer), shared=True, size=size, dtype=torch.uint8)
        ring_in = torch.from_file(name("ring", peer, me), shared=True, size=size, dtype=torch.uint8)
    except OSError as e:
        raise RuntimeError(f"shm p2p: rank {me} could not open its link with rank {peer} in {path}: {e}") from e
    store.set(prefix + f"open/{me}", "1")
    _wait_key(store, prefix + f"open/{peer}", me, peer, "open its ends of the link", timeout)
    if me < peer:
        shutil.rmtree(path, ignore_errors=True)  # both have them open: the memory lives while mapped
    return Channel(me, peer, _Direction(ring_out, data_out, credit_in), _Direction(ring_in, data_in, credit_out))


def _current_store():
    """The default process group's store; a new one (a new process group) closes the old channels."""
    global _store_of_channels
    store = dist.distributed_c10d._get_default_store()
    if store is not _store_of_channels:
        for old in _channels.values():
            old.close()
        _channels.clear()
        _unavailable.clear()
        _hosts.clear()
        _store_of_channels = store
    return store


def channel(group, peer: int) -> Channel:
    """This process's channel with global rank `peer` in `group` (set up on first use; both ranks
    must ask, in an order that does not deadlock: StageLinks asks for its peers in rank order)."""
    store = _current_store()
    name = (group if group is not None else dist.group.WORLD).group_name
    live = set(dist.distributed_c10d._world.pg_names.values())
    for key in [key for key in _channels if key[0] not in live]:  # their groups were destroyed
        _channels.pop(key).close()
    if (name, peer) in _unavailable:  # decided once per pair and group, as both ranks agreed it
        raise _unavailable[(name, peer)]
    if (name, peer) not in _channels:
        try:
            _channels[(name, peer)] = connect(store, name, dist.get_rank(), peer)
        except ShmUnavailable as e:
            _unavailable[(name, peer)] = e
            raise
    return _channels[(name, peer)]


_hosts: dict[int, bool] = {}  # peer -> on this host (for the current store)


def same_host(peer: int) -> bool:
    """Whether global rank `peer` runs on this rank's host. Each side publishes its own host id in
    the default store and reads the other's, so both ends of a pair agree."""
    store = _current_store()
    if peer not in _hosts:
        me, mine = dist.get_rank(), host_id()
        store.set(f"megazero/p2p-shm/host/{me}", mine)
        theirs = _wait_key(store, f"megazero/p2p-shm/host/{peer}", me, peer, "publish its host", _timeout())
        _hosts[peer] = theirs.decode() == mine
    return _hosts[peer]
