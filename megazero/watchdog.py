"""Hung-rank watchdog: a rank stuck in a collective names the ranks it waits for and ends the job.

megazero.initialize() starts it when the engine config's `watchdog` block is enabled (the
recipes' configs do; the library default is off). Every rank then runs two daemon threads:

- the store thread writes this rank's record into the rendezvous store (the TCPStore that
  init_process_group already uses, through a connection of its own) every `interval` seconds: a
  heartbeat, with its step, the operation it waits in and its count of completed operations;
  while this rank has been waiting for a third of the timeout it also reads every rank's record;
- the monitor thread looks at what the main thread waits in. The communication choke points
  (Handle.wait in megazero.zero.collectives, all_reduce_values, the pipeline's point-to-point
  calls, the checkpoint and end-of-run barriers) mark entering and leaving an operation in memory
  only: a list append and pop, no store traffic; with the watchdog off they test one global and go on.

Once this rank has waited longer than `timeout`, the verdict:

1. a peer whose heartbeat has stopped (no new beat for `stale_after` seconds by this rank's
   clock: SIGSTOP, a frozen or dead process, a lost node) or that has exited will not arrive:
   trip. So does a main thread that has entered or left no operation at all for `timeout` while
   a peer's heartbeat has stopped, which catches the waits that are not marked;
2. every peer is waiting too (its record says so, for half the timeout or more) and none is
   computing: a deadlock (mismatched collectives, a lost message): trip;
3. otherwise a peer is alive and busy (writing a checkpoint, evaluating, a slow filesystem) and
   will arrive: keep waiting, silently. A peer alive but never arriving (an endless loop, a
   filesystem that never answers while its heartbeat thread runs) is left to the process
   group's own timeout (init_distributed's, 30 minutes).

Tripping prints on stderr the operation with its step and micro-batch or pipeline stage, and each
rank that has not arrived with its last record; SIGKILLs the stopped peers that run on this host
(checked by boot id, pid and process start time; the launcher would kill them only after its
grace period, 30 s for torchrun) and exits with EXIT_CODE, so that torchrun or
`srun --kill-on-bad-exit` ends the job. A store that stops answering for `stale_after` is a
verdict of its own: the process hosting it is stopped (rank 0 under srun or mpirun; torchrun's
agent hosts it under torchrun).

On NCCL, Work.wait() returns once the wait is queued on the stream, before the collective is
done, and the CPU blocks later at a host synchronisation: an operation whose works are not
complete when its wait returns stays pending (the monitor asks Work.is_completed()) until they are.

Time during which this process itself was stopped (a job suspended with Ctrl-Z, a paused VM)
does not count: the monitor notices the gap in its own ticks and starts its clocks afresh.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

EXIT_CODE = 75  # EX_TEMPFAIL: a restart (torchrun --max-restarts, Slurm --requeue) may well succeed
PREFIX = "[megazero watchdog]"
_SHOWN = 16  # ranks listed by name in a report line; the rest are counted

_active: Watchdog | None = None
_generation = 0  # watchdogs started in this process: keys of an earlier one are not read again


class _Op:
    """One operation the main thread waits in: what, since when (monotonic), and its works."""

    __slots__ = ("label", "since", "works")

    def __init__(self, label: str, since: float, works: Iterable):
        self.label, self.since, self.works = label, since, works


def _completed(op: _Op) -> bool:
    return all(work.is_completed() for work in op.works)


def active() -> Watchdog | None:
    """The running watchdog of this process, or None."""
    return _active


def watched(label: str) -> Callable:
    """Decorator: calls of the function are an operation named `label` for the watchdog."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            watchdog = _active
            if watchdog is None:
                return fn(*args, **kwargs)
            op = watchdog.begin(label)
            try:
                return fn(*args, **kwargs)
            finally:
                watchdog.end(op)

        return call

    return wrap


def _proc_start(pid: int | str = "self") -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]  # fields after the command name start at field 3


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _traced(pid: int) -> bool:
    """True when a debugger is attached to `pid` (its stop is someone's doing: leave it alone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("TracerPid:") and line.split()[1] != "0" for line in f)
    except OSError:
        return False


def identity() -> dict:
    """What names this process on its host: hostname, boot id, pid and start time."""
    return {"host": socket.gethostname(), "boot": _boot_id(), "pid": os.getpid(), "start": _proc_start()}


def is_this_host(ident: dict) -> bool:
    """True when `ident` (from identity()) is a process that still runs on this host."""
    return (ident.get("boot") is not None and ident.get("host") == socket.gethostname()
            and ident.get("boot") == _boot_id() and _proc_start(ident["pid"]) == ident.get("start"))


def rendezvous_store(timeout: float) -> tuple[Any, str]:
    """(a store for the watchdog's keys, who hosts it): the default process group's store, through a
    TCPStore connection of its own when it is one (so a stuck request blocks neither the main
    thread's store use nor the monitor)."""
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            host = f"torchrun's agent on {store.host}"
        else:
            host = "rank 0's process"
        client = dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=max(timeout, 30.0)))
        return client, f"the rendezvous store at {store.host}:{store.port} (hosted by {host})"
    return store, f"the rendezvous store ({type(store).__name__})"


class _StoreLink(threading.Thread):
    """The store thread: heartbeats this rank's record; reads every rank's record while asked to."""

    def __init__(self, store, rank: int, world_size: int, interval: float, record: Callable[[], dict]):
        super().__init__(name="megazero-watchdog-store", daemon=True)
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval, self.record = interval, record
        self.keys = [f"rank{r}" for r in range(world_size)]
        self.want_read = False
        self.ok_at = time.monotonic()  # when a store call last succeeded (a hung or failing store: old)
        self.records: dict[int, dict] = {}
        self.changed: dict[int, float] = {}  # rank -> when its beat was last seen to change (monotonic)
        self.read_at: float | None = None
        self._beats: dict[int, int] = {}
        self._forget = False
        self.stopping = threading.Event()

    def forget(self) -> None:
        """Start the peers' heartbeat observations afresh (this process was itself stopped)."""
        self._forget = True

    def _call(self, fn, *args):
        result = fn(*args)
        self.ok_at = time.monotonic()
        return result

    def beat(self) -> None:
        """Write this rank's record now."""
        self._call(self.store.set, self.keys[self.rank], json.dumps(self.record()))

    def read(self) -> None:
        """Read every rank's record that exists; note which beats changed since the last read."""
        if self._call(self.store.check, self.keys):
            present = self.keys
        else:
            present = [key for key in self.keys if self._call(self.store.check, [key])]
        values = self._call(self.store.multi_get, present) if present else []
        now = time.monotonic()
        if self._forget:
            self._forget = False
            self._beats.clear()
        records = {}
        for key, value in zip(present, values):
            rank, record = int(key[4:]), json.loads(bytes(value).decode())
            records[rank] = record
            if self._beats.get(rank) != record["beat"]:
                self._beats[rank] = record["beat"]
                self.changed[rank] = now
        self.records, self.read_at = records, now

    def run(self) -> None:
        while not self.stopping.is_set():
            tick = time.monotonic()
            try:
                self.beat()
                if self.want_read:
                    self.read()
            except Exception:  # noqa: BLE001  (a store hiccup must not end the heartbeat; the monitor judges)
                pass
            self.stopping.wait(max(0.0, self.interval - (time.monotonic() - tick)))
        try:
            self.beat()  # the last record: its state says exited or tripped
        except Exception:  # noqa: BLE001  (the store's host may be gone already: nothing to tell)
            pass


class Watchdog:
    """This rank's watchdog: the main thread marks operations (begin/end); the monitor thread
    judges them against `timeout` seconds, and trips (reports and exits) when a peer cannot come."""

    def __init__(self, timeout: float, rank: int, world_size: int, store, store_name: str = "the store",
                 engine=None):
        self.timeout = float(timeout)
        self.interval = min(max(self.timeout / 10, 0.5), 5.0)  # heartbeat and monitor tick
        self.stale_after = 4 * self.interval  # no new beat for this long: the peer is not running
        self.rank, self.world_size = rank, world_size
        self.store_name = store_name
        self._engine = weakref.ref(engine) if engine is not None else lambda: None
        self._kill: list[int] = []  # stopped peers to SIGKILL when tripping (those on this host)
        self._stack: list[_Op] = []
        self._pending: collections.deque[_Op] = collections.deque(maxlen=1024)
        self.completed = 0
        self.last: str | None = None
        self.last_activity = time.monotonic()
        self._awake_since = time.monotonic()
        self._state, self._reason, self._beat = "running", None, 0
        self._ident = identity()
        self.link = _StoreLink(store, rank, world_size, self.interval, self._record)
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._run, name="megazero-watchdog", daemon=True)

    # ---- the main thread's marks (the hot path: keep them to an append and a pop) ----------
    def begin(self, label: str, works: Iterable = ()) -> _Op:
        """The main thread starts waiting in an operation; pass its works if wait() may return early."""
        if self._pending:
            self._prune()
        op = _Op(label, time.monotonic(), works)
        self.last_activity = op.since
        self._stack.append(op)
        return op

    def end(self, op: _Op) -> None:
        """The main thread's wait for `op` returned; works not yet complete keep it pending."""
        stack = self._stack
        if stack and stack[-1] is op:
            stack.pop()
        elif op in stack:
            stack.remove(op)
        self.completed += 1
        self.last = op.label
        self.last_activity = time.monotonic()
        if op.works and not _completed(op):
            self._pending.append(op)

    def _prune(self) -> None:
        # only the main thread pops, so the monitor's snapshot never loses an incomplete operation
        pending = self._pending
        while pending and _completed(pending[0]):
            pending.popleft()

    # ---- what the monitor sees ---------------------------------------------------------
    def context(self) -> str:
        """Where the engine is: 'step S, micro-batch M of N' (and the pipeline stage), or 'after step S'
        between steps; '' without an engine."""
        engine = self._engine()
        if engine is None:
            return ""
        grid = engine.grid
        pipelined = grid is not None and grid.pipeline_model_parallel_size > 1
        micro = engine.steps.micro_batches_started()
        text = f"step {engine.global_steps + 1}" if micro or pipelined else f"after step {engine.global_steps}"
        if micro:
            text += f", micro-batch {micro} of {engine.gradient_accumulation_steps()}"
        if pipelined:
            text += f", pipeline stage {grid.pp_rank + 1} of {grid.pipeline_model_parallel_size}"
        return text

    def waiting(self, now: float | None = None) -> tuple[_Op | None, float, float]:
        """(the operation waited in, seconds waited in marked operations, seconds since the main
        thread last entered or left one), time before this process's own last stop not counted."""
        now = time.monotonic() if now is None else now
        stack = list(self._stack)  # snapshots: the main thread keeps changing both
        ops = stack + [op for op in list(self._pending) if not _completed(op)]
        floor = self._awake_since
        quiet = now - max(self.last_activity, floor)
        if not ops:
            return None, 0.0, quiet
        innermost = stack[-1] if stack else ops[0]
        return innermost, now - max(min(op.since for op in ops), floor), quiet

    def _record(self) -> dict:
        """This rank's heartbeat record (written by the store thread)."""
        op, waited, _ = self.waiting()
        self._beat += 1
        try:
            where = self.context()
        except Exception:  # noqa: BLE001  (an engine mid-teardown must not stop the heartbeat)
            where = ""
        return {**self._ident, "rank": self.rank, "beat": self._beat, "time": time.time(), "state": self._state,
                "where": where, "op": op.label if op else None, "waited": round(waited, 2),
                "done": self.completed, "last": self.last, "reason": self._reason}

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> Watchdog:
        """Write the first record and start both threads."""
        self.link.beat()
        self.link.start()
        self._monitor.start()
        return self

    def stop(self, state: str = "exited") -> None:
        """Stop the threads and leave a last record saying `state` (best effort, at most ~1 s)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._state = state
        self.link.stopping.set()
        self.link.join(1.0)  # it writes the last record; never wait on a store that does not answer
        if self._monitor is not threading.current_thread():
            self._monitor.join(1.0)

    # ---- the monitor -------------------------------------------------------------------
    def _run(self) -> None:
        last_tick, failed = time.monotonic(), False
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if now - last_tick > self.stale_after / 2:  # this process was stopped: start afresh
                self._awake_since = now
                self.link.forget()
            last_tick = now
            try:
                report = self._tick(now)
            except Exception as e:  # noqa: BLE001  (say it once; the next tick may see a sane record again)
                if not failed:
                    failed = True
                    os.write(2, f"{PREFIX} rank {self.rank}: monitor error: {e!r}\n".encode())
                continue
            if report:
                self._trip(report)
                return

    def _tick(self, now: float) -> list[str] | None:
        op, waited, quiet = self.waiting(now)
        self.link.want_read = max(waited, quiet) >= self.timeout / 3
        if max(waited, quiet) < self.timeout:
            return None
        return self.verdict(now, op, waited, quiet)

    def verdict(self, now: float, op: _Op | None, waited: float, quiet: float) -> list[str] | None:
        """The report lines when this rank should trip now (and sets the peers to kill), else None."""
        link = self.link
        marked = waited >= self.timeout
        silent = now - max(link.ok_at, self._awake_since)
        if silent >= self.stale_after:
            return [self._what(op, waited, quiet, marked),
                    f"not arrived: {self.store_name} has not answered for {silent:.1f} s: the process hosting it "
                    f"is stopped, frozen or dead"]
        if link.read_at is None or now - link.read_at > 3 * self.interval:
            return None  # no fresh view of the peers yet
        records = link.records
        peers = [r for r in range(self.world_size) if r != self.rank and r in records]
        stale = [r for r in peers if self._stale(r, now)]
        tripped = [r for r in peers if records[r]["state"] == "tripped"]
        exited = [r for r in peers if records[r]["state"] == "exited"]
        # blocked in a marked operation, a peer that left cannot come either; blocked outside one,
        # only a stopped (or tripped) peer makes the silence a hang rather than long work
        absent = stale + tripped + exited if marked else stale + tripped
        if absent:
            self._kill = stale
            return [self._what(op, waited, quiet, marked),
                    "not arrived: " + "; ".join(self._describe(r, now) for r in absent[:_SHOWN]) + _more(len(absent))]
        waiting = [r for r in peers if records[r]["op"] and records[r]["waited"] >= self.timeout / 2]
        if marked and len(waiting) == self.world_size - 1:
            return [self._what(op, waited, quiet, marked),
                    "not arrived: no rank is stopped, but every rank is waiting (a deadlock: mismatched collectives "
                    "or a lost message): " + "; ".join(self._describe(r, now) for r in waiting[:_SHOWN])
                    + _more(len(waiting))]
        return None  # a peer is alive and busy (a checkpoint save, an evaluation): it will arrive

    def _stale(self, rank: int, now: float) -> bool:
        return self.link.records[rank]["state"] == "running" and now - self.link.changed[rank] >= self.stale_after

    def _what(self, op: _Op | None, waited: float, quiet: float, marked: bool) -> str:
        where = self.context()
        where = f" ({where})" if where else ""
        if marked:
            return f"{op.label}{where} has waited {waited:.1f} s (timeout {self.timeout:g} s)"
        last = f"; the last operation waited for: {self.last}" if self.last else ""
        return (f"no operation entered or left for {quiet:.1f} s (timeout {self.timeout:g} s){where}: blocked "
                f"outside the marked operations{last}")

    def _describe(self, rank: int, now: float) -> str:
        record = self.link.records[rank]
        if record["state"] == "tripped":
            state = f"its watchdog tripped: {record['reason']}"
        elif record["state"] == "exited":
            state = "has exited"
        elif self._stale(rank, now):
            # seen unchanged for this long; its own clock's age of the beat, when larger (clocks agree)
            age = max(now - self.link.changed[rank], time.time() - record["time"])
            state = f"no heartbeat for {age:.1f} s: stopped, frozen or dead"
        else:
            state = f"waiting {record['waited']:.1f} s" if record["op"] else "alive"
        seen = [record["where"]] if record["where"] else []
        seen.append(f"in {record['op']}" if record["op"] else "in no marked operation")
        seen.append(f"{record['done']} operations waited for, the last {record['last']}" if record["last"]
                    else "no operation waited for yet")
        return f"rank {rank} ({state}; last seen {', '.join(seen)}; pid {record['pid']} on {record['host']})"

    def _trip(self, lines: list[str]) -> None:
        self._reason = lines[0]
        killed = []
        for rank in self._kill:
            ident = self.link.records[rank]
            if is_this_host(ident) and not _traced(ident["pid"]):
                try:
                    os.kill(ident["pid"], signal.SIGKILL)
                    killed.append(f"rank {rank} (pid {ident['pid']})")
                except OSError:
                    pass
        ending = f"killed {', '.join(killed)} on this host; " if killed else ""
        lines.append(f"{ending}exiting with code {EXIT_CODE} so that the launcher ends the job")
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001  (a closed stdout must not keep a hung job alive)
            pass
        text = "".join(f"{PREFIX} rank {self.rank}: {line}\n" for line in lines)
        os.write(2, text.encode())
        self.stop("tripped")
        os._exit(EXIT_CODE)


def _more(count: int) -> str:
    return f"; and {count - _SHOWN} more" if count > _SHOWN else ""


def _stop_active() -> None:
    global _active
    watchdog, _active = _active, None
    if watchdog is not None:
        watchdog.stop()


def configure_watchdog(config, engine=None) -> Watchdog | None:
    """Start this process's watchdog per the engine config's `watchdog` block (stopping one an
    earlier engine started), or stop it when the block is disabled; None with no peers to wait on."""
    global _active, _generation
    _stop_active()
    if not config.enabled or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    store, name = rendezvous_store(config.timeout)
    _generation += 1
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    prefix = f"megazero/watchdog/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_generation}/"
    watchdog = Watchdog(config.timeout, dist.get_rank(), dist.get_world_size(), dist.PrefixStore(prefix, store),
                        name, engine)
    _active = watchdog.start()
    return watchdog


def _forget_in_child() -> None:
    # a forked child (a data-loader worker) has none of the threads: it must not report as this rank
    global _active
    _active = None


atexit.register(_stop_active)
os.register_at_fork(after_in_child=_forget_in_child)
