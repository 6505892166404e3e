"""Run a recipe with a stall injected on one rank: `python stalled_rank.py RECIPE ARGS...` under torchrun.

The test's stand-ins for a healthy run that is slow, not hung: on rank MEGAZERO_TEST_SLOW_FSYNC_RANK
the first os.fsync() inside a checkpoint save sleeps MEGAZERO_TEST_STALL seconds (a slow
filesystem), and on rank MEGAZERO_TEST_SLOW_EVAL_RANK the first evaluation batch does (a long
evaluation). Each stall prints one line saying whether the watchdog was running during it.
"""

from __future__ import annotations

import os
import runpy
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import megazero.watchdog  # noqa: E402
from megazero.engine import Engine  # noqa: E402

RANK = int(os.environ["RANK"])
STALL = float(os.environ.get("MEGAZERO_TEST_STALL", "20"))


def stall_once(fn, what: str, when=lambda: True):
    """fn, with its first call on this rank for which when() holds preceded by a STALL-second sleep."""
    stalled = []

    def call(*args, **kwargs):
        if not stalled and when():
            stalled.append(True)
            on = "on" if megazero.watchdog.active() is not None else "off"
            print(f"[stalled_rank] rank {RANK}: {what} stalls {STALL:g} s, watchdog {on}", flush=True)
            time.sleep(STALL)
        return fn(*args, **kwargs)

    return call


saving = []


def mark_saving(save):
    def call(*args, **kwargs):
        saving.append(True)
        try:
            return save(*args, **kwargs)
        finally:
            saving.pop()

    return call


if os.environ.get("MEGAZERO_TEST_SLOW_FSYNC_RANK") == str(RANK):
    Engine.save_checkpoint = mark_saving(Engine.save_checkpoint)
    os.fsync = stall_once(os.fsync, "fsync in a checkpoint save", when=lambda: bool(saving))
if os.environ.get("MEGAZERO_TEST_SLOW_EVAL_RANK") == str(RANK):
    Engine.eval_batch = stall_once(Engine.eval_batch, "evaluation")

recipe = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(recipe, run_name="__main__")
