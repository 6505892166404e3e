"""Swap files: tensors written to and read back from files of one run and one rank, through the
asynchronous I/O op (megazero.ops.aio). Used by optimizer offload (megazero.zero.offload); meant
to be reused for parameter offload.

    directory = SwapDirectory(nvme_path, run_id, rank)   # <nvme_path>/megazero-swap/<run_id>/rank<rank>/
    files = SwapFiles(directory, AsyncIO(...))
    request = files.submit_write("name", tensor)          # whole tensor -> file "name.swp"
    files.wait(request)
    files.wait(files.submit_read("name", into))           # into: same byte size as last written
    files.submit_write_part("name", piece, offset, file_bytes)   # a file written piece by piece
    files.submit_read_part("name", into, offset)
    files.close()                                         # removes the directory (also at exit, GC)

Every file starts with a header block (magic, run id, rank, name, bytes); data starts at
HEADER_BYTES, so that direct I/O keeps its alignment. A read is only allowed of a name this
`SwapFiles` wrote, and checks the file's header against this run: a stale set (a crashed earlier
run's, or a file put in place by anything else) is never read as current. The directory is new for
every run id (it must not exist); at start-up the directories of dead earlier runs on this host
(owner pid gone) are removed, with a warning. The directory is removed at close(), when the object
is garbage collected, and at interpreter exit (also after an unhandled exception).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
import warnings
import weakref

import torch
import torch.distributed as dist

HEADER_BYTES = 4096
MAGIC = b"MEGAZERO-SWAP-1\n"
ROOT_NAME = "megazero-swap"
OWNER_FILE = "owner.json"


def new_run_id() -> str:
    """A run id no other run has: time and a random suffix."""
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:12]


def agreed_run_id(group=None) -> str:
    """One run id for the whole data-parallel `group` (its rank 0's), so that every rank's swap
    directory of one run carries the same id."""
    run_id = [new_run_id()]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(run_id, src=src, group=group)
    return run_id[0]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    try:  # the run's directory goes with its last rank
        os.rmdir(os.path.dirname(path))
    except OSError:
        pass


class SwapDirectory:
    """<nvme_path>/megazero-swap/<run_id>/rank<rank>/, created empty (never reused) and removed at
    close(), garbage collection or interpreter exit."""

    def __init__(self, nvme_path: str | os.PathLike, run_id: str, rank: int):
        self.run_id = run_id
        self.rank = rank
        self.root = os.path.join(os.fspath(nvme_path), ROOT_NAME)
        os.makedirs(self.root, exist_ok=True)
        remove_stale_runs(self.root)
        self.path = os.path.join(self.root, run_id, f"rank{rank}")
        for attempt in range(10):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            try:
                os.mkdir(self.path)
                break
            except FileExistsError:
                raise FileExistsError(f"swap directory {self.path} exists already: run id {run_id!r} is not "
                                      f"new") from None
            except FileNotFoundError:  # another rank removed the run's directory while it looked empty
                if attempt == 9:
                    raise
        with open(os.path.join(self.path, OWNER_FILE), "w") as f:
            json.dump({"run_id": run_id, "rank": rank, "host": socket.gethostname(), "pid": os.getpid()}, f)
        self._finalizer = weakref.finalize(self, _remove, self.path)

    def file(self, name: str) -> str:
        """The path of swap file `name`."""
        return os.path.join(self.path, f"{name}.swp")

    def close(self) -> None:
        """Remove the directory (and the run's, once empty)."""
        self._finalizer()


def remove_stale_runs(root: str) -> list[str]:
    """Remove the rank directories under `root` whose owner process (on this host) is gone: what a
    killed run left behind. Returns what was removed."""
    removed = []
    host = socket.gethostname()
    for run in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        for rank in sorted(os.listdir(os.path.join(root, run))) if os.path.isdir(os.path.join(root, run)) else []:
            path = os.path.join(root, run, rank)
            try:
                with open(os.path.join(path, OWNER_FILE)) as f:
                    owner = json.load(f)
            except (OSError, ValueError):
                continue  # not ours, or being created right now: leave it
            if owner.get("host") == host and not _pid_alive(int(owner.get("pid", -1))):
                _remove(path)
                removed.append(path)
    if removed:
        warnings.warn(f"removed {len(removed)} stale swap director{'y' if len(removed) == 1 else 'ies'} of "
                      f"runs that ended without cleaning up: {', '.join(removed)}", stacklevel=3)
    return removed


class StaleSwapError(RuntimeError):
    """A swap file does not belong to this run (or was never written by it)."""


class SwapFiles:
    """Named swap files in a SwapDirectory, written and read whole through an AsyncIO op.

    submit_write/submit_read return a request id for wait(); a tensor must stay untouched until
    its request is waited for. Byte counts (`bytes_written`, `bytes_read`) are kept for reports."""

    def __init__(self, directory: SwapDirectory, aio):
        self.directory = directory
        self.aio = aio
        self._written: dict[str, int] = {}  # name -> bytes of its last write
        self.bytes_written = 0
        self.bytes_read = 0

    def _header(self, name: str, nbytes: int) -> bytes:
        meta = json.dumps({"run_id": self.directory.run_id, "rank": self.directory.rank, "name": name,
                           "bytes": nbytes}).encode()
        return (MAGIC + meta).ljust(HEADER_BYTES, b"\0")

    def _header_for(self, name: str, nbytes: int) -> None:
        if self._written.get(name) != nbytes:  # a new file, or a new size: a new header
            fd = os.open(self.directory.file(name), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.pwrite(fd, self._header(name, nbytes), 0)
            finally:
                os.close(fd)
            self._written[name] = nbytes

    def rewrite_header(self, name: str) -> None:
        """Write file `name`'s header again at its next write (e.g. retrying a failed one: the file may
        have been replaced meanwhile)."""
        self._written.pop(name, None)

    def submit_write(self, name: str, tensor: torch.Tensor, after: int | None = None) -> int:
        """Start writing `tensor` (contiguous, CPU) as the whole content of file `name` (`after`: once
        that request has finished; not at all if it failed)."""
        nbytes = tensor.numel() * tensor.element_size()
        self._header_for(name, nbytes)
        self.bytes_written += nbytes
        return self.aio.submit_write(tensor, self.directory.file(name), HEADER_BYTES, after=after)

    def submit_write_part(self, name: str, tensor: torch.Tensor, offset: int, file_bytes: int) -> int:
        """Start writing `tensor` (contiguous, CPU) at byte `offset` of the content of file `name`, a
        file of `file_bytes` written piece by piece (and read back by submit_read_part)."""
        nbytes = tensor.numel() * tensor.element_size()
        if offset < 0 or offset + nbytes > file_bytes:
            raise ValueError(f"{self.directory.file(name)}: a write of {nbytes} bytes at {offset} does not fit "
                             f"its {file_bytes} bytes")
        self._header_for(name, file_bytes)
        self.bytes_written += nbytes
        return self.aio.submit_write(tensor, self.directory.file(name), HEADER_BYTES + offset)

    def submit_read_part(self, name: str, tensor: torch.Tensor, offset: int, check: bool = True) -> int:
        """Start reading `tensor`'s bytes from byte `offset` of file `name`'s content (a piece this
        run wrote by submit_write_part); `check`: verify the header first (see check())."""
        nbytes = tensor.numel() * tensor.element_size()
        if check:
            self.check(name, self._written.get(name, -1))
        if offset < 0 or offset + nbytes > self._written[name]:
            raise ValueError(f"{self.directory.file(name)}: a read of {nbytes} bytes at {offset} is outside its "
                             f"{self._written[name]} bytes")
        self.bytes_read += nbytes
        return self.aio.submit_read(tensor, self.directory.file(name), HEADER_BYTES + offset)

    def check(self, name: str, nbytes: int) -> None:
        """Raise StaleSwapError unless file `name` is this run's, holding `nbytes` written by us."""
        path = self.directory.file(name)
        if name not in self._written:
            raise StaleSwapError(f"{path}: never written by this run (run id {self.directory.run_id})")
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        meta = None
        if head.startswith(MAGIC):
            try:
                meta = json.loads(head[len(MAGIC):].rstrip(b"\0"))
            except ValueError:
                meta = None
        expected = {"run_id": self.directory.run_id, "rank": self.directory.rank, "name": name,
                    "bytes": self._written[name]}
        if meta != expected:
            raise StaleSwapError(f"{path}: header {meta} does not belong to this run: expected {expected}")
        if nbytes != self._written[name]:
            raise ValueError(f"{path}: holds {self._written[name]} bytes, a read of {nbytes} was asked")

    def submit_read(self, name: str, tensor: torch.Tensor, check: bool = True, after: int | None = None) -> int:
        """Start reading file `name` into `tensor` (contiguous, CPU, the byte size last written);
        `check`: verify the header first (see check()); `after`: once that request (e.g. the write of
        what is read) has finished, and not at all (tensor untouched) if it failed."""
        nbytes = tensor.numel() * tensor.element_size()
        if check:
            self.check(name, nbytes)
        self.bytes_read += nbytes
        return self.aio.submit_read(tensor, self.directory.file(name), HEADER_BYTES, after=after)

    def wait(self, request: int | None = None) -> None:
        """Wait for one request (None: all); raises OSError naming the file and errno."""
        self.aio.wait(request)

    def disk_bytes(self) -> int:
        """Bytes the swap files take (headers included)."""
        return sum(HEADER_BYTES + n for n in self._written.values())

    def close(self) -> None:
        """Wait for what is in flight, then remove the directory."""
        try:
            self.aio.wait()
        finally:
            self.directory.close()


def run_swap_files(nvme_path: str | os.PathLike, group, aio_config: dict) -> SwapFiles:
    """This rank's swap files of one run under `nvme_path`: a directory named by the run id the
    data-parallel `group` agrees on, written through the asynchronous I/O op (`aio_config`: the
    engine config's `aio` block)."""
    from megazero.ops.aio import AsyncIO

    rank = dist.get_rank() if dist.is_initialized() else 0
    return SwapFiles(SwapDirectory(nvme_path, agreed_run_id(group), rank), AsyncIO(**aio_config))
