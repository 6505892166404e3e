"""Parameter offload's one device-specific step: a host partition copied to the compute device for
its gather (megazero.zero.param_offload), ZeRO-Infinity's host -> GPU leg.

    staging = PartitionStaging(torch.device("cuda", 0), pin=True)
    staging.start(key, host)        # copy started (a side CUDA stream, non_blocking), or nothing
    on_device = staging.take(key, host)   # the partition on the compute device, ordered for this stream
    staging.release(key)            # the copy is done with; the host buffer may be reused after this
    with staging.side():            # work queued on the side stream (the copy into the gather buffer
        ...                         # and its all-gather), so that it overlaps the compute stream's
    event = staging.ready()         # ... and the point the compute stream waits for at use:
    staging.wait_ready(event, full) # (both no-ops on the CPU)

On the CPU (`device` None) it is the identity: take() returns `host` itself, nothing is copied or
allocated, so the CPU path stays the in-memory arithmetic with no copy made twice. With a CUDA
device each copy runs on one side stream into a new device tensor and records an event; take()
makes the current stream wait for that event and marks the tensor used there, so the caching
allocator does not hand its memory out before that stream is done with it. (The staged gather
calls take() inside side(), so the copy into the gather buffer and the all-gather follow it on the
side stream, and only wait_ready() puts a wait on the compute stream.) release() waits for the
copy itself (cheap: the gather has already waited for it on the device), because the host buffer it
reads may be overwritten next (a pool buffer given to the next read, or the cast of the update).
`force_copy` with a CPU device copies into a separate host buffer the same way (no streams): the
same bookkeeping, testable without a GPU.
"""

from __future__ import annotations

import contextlib

import torch


def pinned(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """`t` in page-locked memory when `pin` and CUDA is available (a copy), else `t` itself."""
    return t.pin_memory() if pin and torch.cuda.is_available() else t


class PartitionStaging:
    """Copies of host partitions on the compute device, keyed by the caller (see the module docstring).
    `copies`: copies made; `live` / `peak_live`: staged copies held now / at most."""

    def __init__(self, device: torch.device | None = None, pin: bool = False, force_copy: bool = False):
        if device is not None and device.type not in ("cpu", "cuda"):
            raise ValueError(f"parameter offload to host memory for parameters on {device.type!r} is not "
                             f"implemented (cpu and cuda are)")
        self.identity = device is None or (device.type == "cpu" and not force_copy)
        self.device = None if self.identity else device
        self.pin = pin and self.device is not None and self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.device is not None and self.device.type == "cuda" \
            else None
        self._staged: dict[int, tuple[torch.Tensor, object]] = {}  # key -> (device copy, its event or None)
        self.copies = 0
        self.peak_live = 0

    @property
    def live(self) -> int:
        return len(self._staged)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """`t` in host memory (pinned when asked, with CUDA): a partition's home; `t` itself when it
        is on the CPU already."""
        return t if t.device.type == "cpu" else pinned(t.detach().cpu(), self.pin)

    def start(self, key: int, host: torch.Tensor) -> None:
        """Start copying `host` to the compute device (nothing when identity or already staged)."""
        if self.identity or key in self._staged:
            return
        if self.stream is None:  # force_copy on the CPU
            copy = torch.empty_like(host)
            copy.copy_(host)
            event = None
        else:
            with torch.cuda.stream(self.stream):
                copy = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                copy.copy_(host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
        self._staged[key] = (copy, event)
        self.copies += 1
        self.peak_live = max(self.peak_live, len(self._staged))

    def take(self, key: int, host: torch.Tensor) -> torch.Tensor:
        """The partition on the compute device, safe to read on the current stream (started here if
        start() was not called); identity: `host` itself."""
        if self.identity:
            return host
        self.start(key, host)
        copy, event = self._staged[key]
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            copy.record_stream(current)
        return copy

    def release(self, key: int) -> None:
        """Drop `key`'s device copy, once the copy has read its host buffer."""
        staged = self._staged.pop(key, None)
        if staged is not None and staged[1] is not None:
            staged[1].synchronize()

    def side(self):
        """A context in which work is queued on the side stream (nothing on the CPU): the unit's
        gather buffer is allocated, filled and all-gathered there, ahead of the compute stream."""
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def ready(self):
        """An event marking the side stream's work so far (None on the CPU)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait_ready(self, event, *used: torch.Tensor) -> None:
        """The current stream waits for `event` (from ready()); `used`, allocated on the side stream,
        are marked used on the current stream, so that their memory outlives its work."""
        if event is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in used:
            t.record_stream(current)
