"""Named wall-clock timers for the engine's phases (`wall_clock_breakdown`)."""

from __future__ import annotations

import time

import torch

from megazero.distributed import all_reduce_values


class _Timer:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.elapsed = 0.0
        self.count = 0
        self._start: float | None = None

    def start(self) -> None:
        if self.enabled:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self.enabled and self._start is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.elapsed += time.perf_counter() - self._start
            self.count += 1
            self._start = None


class Timers:
    """`timers(name).start()/.stop()`; `log(names)` prints per-call means (min/max over ranks) and resets.

    Disabled timers cost one attribute check, so the engine can always call them.
    """

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self._timers: dict[str, _Timer] = {}

    def __call__(self, name: str) -> _Timer:
        if name not in self._timers:
            self._timers[name] = _Timer(self.enabled)
        return self._timers[name]

    def means_ms(self, names: list[str], reset: bool = True) -> dict[str, float]:
        """Mean milliseconds per call of each named timer on this rank."""
        out = {}
        for name in names:
            timer = self._timers.get(name)
            out[name] = 1000.0 * timer.elapsed / timer.count if timer and timer.count else 0.0
            if timer and reset:
                timer.elapsed, timer.count = 0.0, 0
        return out

    def log(self, names: list[str], group=None, rank: int = 0) -> str:
        """Print (on rank 0) each timer's mean with its min and max across ranks; returns the line."""
        means = self.means_ms(names)
        values = [means[n] for n in names]
        low = all_reduce_values(values, "min", group)
        high = all_reduce_values(values, "max", group)
        line = " | ".join(f"{n}: {means[n]:.2f} ms (min {lo:.2f}, max {hi:.2f})"
                          for n, lo, hi in zip(names, low, high))
        if rank == 0:
            print(f"[megazero] time per call: {line}", flush=True)
        return line
