"""Asynchronous reads and writes of tensors to and from files, so that swapping overlaps compute.

`AsyncIO` queues a request (a tensor's bytes, a file, an offset) and returns its id at once; worker
threads move it in `block_size` chunks, at most `queue_depth` per I/O thread in flight
(thread_count x queue_depth: pread/pwrite block, so each chunk in flight has a worker of its own,
as a libaio queue of that depth would); `wait` blocks until it is done and raises an OSError naming
the path and errno if it failed. A request submitted `after=` another starts once that one has
finished and, if that one failed, is not run (ECANCELED, its tensor untouched). The parameters are DeepSpeed's
`aio` config block (block_size, queue_depth, thread_count, single_submit, overlap_events):
single_submit keeps one chunk per request in flight, overlap_events=False runs requests one after
the other in submission order.

Two engines with the same semantics:
- the C++ op `aio` (csrc/aio.cpp): pread/pwrite on std::threads, O_DIRECT for the 4096-aligned
  body of a request where the tensor's address and the offset are aligned (`aligned_empty` makes
  such tensors) and the file system allows it, buffered I/O for the tail and everywhere else;
- a pure-Python fallback (threads around os.pread/os.pwrite, buffered), used when the op cannot be
  built (`use_op=None`) or when asked for (`use_op=False`).
Writes never truncate: the file grows as needed, bytes outside the request are kept. A read needs
the whole range to exist (a read past the end of the file fails with ENODATA).
"""

from __future__ import annotations

import ctypes
import errno as errno_codes
import os
import threading
import time
from collections import deque

import torch

from megazero.ops import builder

ALIGNMENT = 4096  # the O_DIRECT alignment the op uses (address, offset, length)


def aio_op():
    """The compiled op, or None (the pure-Python engine is then used)."""
    return builder.load_op("aio")


def active_backend() -> str:
    """Which engine `AsyncIO()` would use, from the op's build status (builds nothing)."""
    s = builder.status("aio")
    if s["loaded"] or (s["built"] and not s["fallback"]):
        return "cpp op (O_DIRECT where aligned and the file system allows it, else buffered)"
    if s["compatible"] and not s["fallback"]:
        return "cpp op once built (lazily on first use, or `python -m megazero.ops build`)"
    return f"python fallback (threads + os.pread/os.pwrite, buffered): {s['why']}"


def aligned_empty(shape, dtype: torch.dtype, alignment: int = ALIGNMENT, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor whose data pointer is a multiple of `alignment`
    (what O_DIRECT needs). It views a slightly larger byte buffer (page-locked with `pin_memory`,
    which needs CUDA)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if alignment < 1 or alignment & (alignment - 1) or alignment % itemsize:
        raise ValueError(f"alignment must be a power of two and a multiple of {dtype}'s {itemsize} bytes, "
                         f"got {alignment}")
    shape = torch.Size([shape] if isinstance(shape, int) else shape)
    nbytes = shape.numel() * itemsize
    buffer = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin_memory)
    start = -buffer.data_ptr() % alignment
    return buffer[start:start + nbytes].view(dtype).view(shape)


class _PythonEngine:
    """The fallback: the op's scheduling (chunks, queue depth, single_submit, overlap_events) on
    Python threads; os.pread/os.pwrite release the GIL, so chunks overlap with the caller."""

    def __init__(self, block_size: int, queue_depth: int, thread_count: int, single_submit: bool,
                 overlap_events: bool):
        self._block, self._depth = block_size, queue_depth
        self._single, self._overlap = single_submit, overlap_events
        self._cv = threading.Condition()
        self._requests: dict[int, dict] = {}
        self._active: deque[dict] = deque()
        self._in_flight = 0
        self._next_id = 1
        self._stop = False
        self._flying, self._busy, self._since = [0, 0, 0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
        self._depth = queue_depth * thread_count  # per thread: one worker per chunk in flight
        self._workers = [threading.Thread(target=self._work, daemon=True, name=f"megazero-aio-{i}")
                         for i in range(self._depth)]
        for w in self._workers:
            w.start()

    def submit(self, tensor: torch.Tensor, path: str, offset: int, write: bool, after: int = 0) -> int:
        nbytes = tensor.nbytes
        r = {"write": write, "path": path, "offset": offset, "chunks": [], "next": 0, "done": 0, "in_flight": 0,
             "err": 0, "what": "", "fd": -1, "blocked": False, "dependents": [],
             "buf": (ctypes.c_char * nbytes).from_address(tensor.data_ptr()) if nbytes else None}
        try:
            r["fd"] = os.open(path, (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | os.O_CLOEXEC, 0o644)
        except OSError as e:
            r["err"], r["what"] = e.errno, f"open for {'writing' if write else 'reading'}"
        else:
            r["chunks"] = [(pos, min(self._block, nbytes - pos)) for pos in range(0, nbytes, self._block)]
        with self._cv:
            r["id"] = rid = self._next_id
            self._next_id += 1
            self._requests[rid] = r
            before = self._requests.get(after) if after else None
            if before is not None and before is not r and not self._finished(r):
                if not self._finished(before):
                    r["blocked"] = True
                    before["dependents"].append(r)
                elif before["err"]:
                    self._cancel(r, after)
            if self._finished(r):
                self._close(r)
            else:
                self._active.append(r)
                self._cv.notify_all()
        return rid

    @staticmethod
    def _finished(r: dict) -> bool:
        return r["done"] == len(r["chunks"])

    @staticmethod
    def _cancel(r: dict, after: int) -> None:
        r["err"], r["what"] = errno_codes.ECANCELED, f"not run: the request it was submitted after ({after}) failed"
        r["next"] = r["done"] = len(r["chunks"])

    @staticmethod
    def _close(r: dict) -> None:
        if r["fd"] >= 0:
            os.close(r["fd"])
            r["fd"] = -1

    def wait(self, request: int) -> tuple[int, str]:
        with self._cv:
            if request not in self._requests:
                raise RuntimeError(f"aio: no outstanding request {request} (already waited for, or never submitted)")
            r = self._requests[request]
            self._cv.wait_for(lambda: self._finished(r))
            del self._requests[request]
            return r["err"], r["what"]

    def is_direct(self, request: int) -> bool:
        return False

    def _count(self, kind: int, delta: int) -> None:  # (with the lock held) as the op's busy()
        for k in (kind, 2):
            now = time.perf_counter()
            if delta > 0:
                if self._flying[k] == 0:
                    self._since[k] = now
                self._flying[k] += 1
            else:
                self._flying[k] -= 1
                if self._flying[k] == 0:
                    self._busy[k] += now - self._since[k]

    def busy_seconds(self) -> tuple[float, float, float]:
        with self._cv:
            now = time.perf_counter()
            return tuple(b + (now - s if f else 0.0) for b, s, f in zip(self._busy, self._since, self._flying))

    def drain(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: not self._active)

    def close(self) -> None:
        """Finish what was submitted, then stop the threads."""
        self.drain()
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for w in self._workers:
            w.join()

    def _pick(self) -> dict | None:
        if self._in_flight >= self._depth:
            return None
        for r in self._active:
            if not r["blocked"] and r["next"] < len(r["chunks"]) and not (self._single and r["in_flight"]):
                return r
            if not self._overlap:
                return None
        return None

    def _work(self) -> None:
        with self._cv:
            while True:
                self._cv.wait_for(lambda: self._stop or self._pick() is not None)
                r = self._pick()
                if r is None:
                    return
                pos, length = r["chunks"][r["next"]]
                r["next"] += 1
                r["in_flight"] += 1
                self._in_flight += 1
                self._count(1 if r["write"] else 0, +1)
                skip = r["err"] != 0
                self._cv.release()
                err, what = 0, ""
                try:
                    if not skip:
                        err = self._transfer(r, pos, length)
                        if err:
                            what = (f"{'pwrite' if r['write'] else 'pread'} of {length} bytes at file offset "
                                    f"{r['offset'] + pos} (buffered)")
                finally:
                    self._cv.acquire()
                if err and not r["err"]:
                    r["err"], r["what"] = err, what
                r["in_flight"] -= 1
                self._in_flight -= 1
                self._count(1 if r["write"] else 0, -1)
                r["done"] += 1
                if self._finished(r):
                    self._close(r)
                    self._active.remove(r)
                    for d in r["dependents"]:  # released: run, or failed unrun if this one failed
                        d["blocked"] = False
                        if r["err"]:
                            self._cancel(d, r["id"])
                            self._close(d)
                            self._active.remove(d)
                    r["dependents"] = []
                self._cv.notify_all()

    @staticmethod
    def _transfer(r: dict, pos: int, length: int) -> int:
        """The whole chunk (short transfers continued); 0 or the errno (ENODATA: end of file)."""
        view = memoryview(r["buf"]).cast("B")[pos:pos + length]
        moved = 0
        while moved < length:
            try:
                if r["write"]:
                    n = os.pwrite(r["fd"], view[moved:], r["offset"] + pos + moved)
                else:
                    n = os.preadv(r["fd"], [view[moved:]], r["offset"] + pos + moved)
            except OSError as e:
                return e.errno or errno_codes.EIO
            if n == 0:
                return errno_codes.EIO if r["write"] else errno_codes.ENODATA
            moved += n
        return 0


class AsyncIO:
    """Submit reads and writes of contiguous CPU tensors to files, wait for them later.

    `use_op`: None = the C++ op if it builds, else the pure-Python engine; False = the Python
    engine; True = the op or an error. The tensor of a request is kept alive until it is waited for.
    """

    def __init__(self, block_size: int = 1048576, queue_depth: int = 8, thread_count: int = 1,
                 single_submit: bool = False, overlap_events: bool = True, use_op: bool | None = None):
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth), ("thread_count", thread_count)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"aio {name} must be an int >= 1, got {value!r}")
        op = None if use_op is False else aio_op()
        if op is None and use_op:
            raise RuntimeError("the aio op was requested (use_op=True) but could not be built: "
                               f"{builder.status('aio')['why']}")
        args = (block_size, queue_depth, thread_count, bool(single_submit), bool(overlap_events))
        self._engine = op.Handle(*args) if op is not None else _PythonEngine(*args)
        self._cpp = op is not None
        self.block_size, self.queue_depth, self.thread_count = block_size, queue_depth, thread_count
        self.single_submit, self.overlap_events = bool(single_submit), bool(overlap_events)
        self._outstanding: dict[int, tuple[torch.Tensor, str]] = {}  # id -> (tensor kept alive, path)
        self._last_direct = True

    @property
    def backend(self) -> str:
        """"python", or "cpp (O_DIRECT)" / "cpp (buffered)": how the op ran the latest request
        (before any, "cpp (O_DIRECT)", what it tries first)."""
        if not self._cpp:
            return "python"
        return "cpp (O_DIRECT)" if self._last_direct else "cpp (buffered)"

    def _submit(self, tensor: torch.Tensor, path, offset: int, write: bool, after: int | None = None) -> int:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"aio needs a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"aio needs a contiguous CPU tensor, got one on {tensor.device} "
                             f"(contiguous={tensor.is_contiguous()}, shape {tuple(tensor.shape)})")
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"aio offset must be an int >= 0, got {offset!r}")
        if after is not None and after not in self._outstanding:
            raise ValueError(f"aio: a request after {after}, which is not outstanding (already waited for, or "
                             f"never submitted)")
        path = os.fsdecode(os.fspath(path))
        tensor = tensor.detach()
        request = self._engine.submit(tensor, path, offset, write, after or 0)
        self._outstanding[request] = (tensor, path)
        if self._cpp and tensor.nbytes >= ALIGNMENT:
            self._last_direct = self._engine.is_direct(request)
        return request

    def submit_write(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0,
                     after: int | None = None) -> int:
        """Queue a write of the tensor's bytes at `offset` of `path` (created if missing); the request id.
        `after`: an outstanding request this one waits for (not run if that one fails)."""
        return self._submit(tensor, path, offset, True, after)

    def submit_read(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0,
                    after: int | None = None) -> int:
        """Queue a read of `tensor.nbytes` bytes at `offset` of `path` into the tensor; the request id.
        `after`: an outstanding request this one waits for (not run if that one fails)."""
        return self._submit(tensor, path, offset, False, after)

    def wait(self, request: int | None = None) -> None:
        """Block until `request` (or every outstanding request) is done; an OSError naming the path
        and errno if one failed (after all of them are done, the first failure in submission order)."""
        if request is not None:
            if request not in self._outstanding:
                raise ValueError(f"aio request {request} is not outstanding (already waited for, or never "
                                 f"submitted); outstanding: {sorted(self._outstanding)}")
            requests = [request]
        else:
            requests = sorted(self._outstanding)
        failure = None
        for rid in requests:
            err, what = self._engine.wait(rid)
            _, path = self._outstanding.pop(rid)
            if err and failure is None:
                failure = OSError(err, f"{os.strerror(err)} ({what})", path)
        if failure is not None:
            raise failure

    def busy_seconds(self) -> dict[str, float]:
        """Seconds (since this AsyncIO was made) during which at least one read chunk ("read"), one
        write chunk ("write"), any chunk ("any") was in flight: the time I/O was actually happening."""
        return dict(zip(("read", "write", "any"), self._engine.busy_seconds()))

    def write(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> None:
        """Write and wait."""
        self.wait(self.submit_write(tensor, path, offset))

    def read(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> None:
        """Read and wait."""
        self.wait(self.submit_read(tensor, path, offset))

    def __del__(self):
        # the tensors of requests not waited for must outlive the threads writing into them
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.drain()
            if isinstance(engine, _PythonEngine):
                engine.close()
