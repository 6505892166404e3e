"""Rank 1 reaches the end-of-run barrier while rank 0 still waits for a message rank 1 never sends
(as when a rank skips work whose collectives its peers run): `torchrun --nproc_per_node=2
end_barrier_deadlock.py TIMEOUT`. Both wait in watched operations; the watchdog must name the
deadlock and exit."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megazero.config import WatchdogConfig  # noqa: E402
from megazero.pipeline import StageLinks  # noqa: E402
from megazero.training import end_of_run_barrier  # noqa: E402
from megazero.watchdog import configure_watchdog  # noqa: E402

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
configure_watchdog(WatchdogConfig(enabled=True, timeout=float(sys.argv[1])))
rank = dist.get_rank()
links = StageLinks([0, 1], rank, dist.group.WORLD, torch.float32, torch.device("cpu"), transport="backend")
print(f"rank {rank}: {'waiting for a message' if rank == 0 else 'at the end of the run'}", flush=True)
links.recv_backward() if rank == 0 else end_of_run_barrier()
