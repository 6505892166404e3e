"""Two pipeline stages that each wait, through the shared-memory transport, for a message the other
never sends: `torchrun --nproc_per_node=2 shm_deadlocked_stages.py TIMEOUT`. The main threads sleep
in poll() inside StageLinks' watched calls; the watchdog must see every rank waiting and exit."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megazero.config import WatchdogConfig  # noqa: E402
from megazero.pipeline import StageLinks  # noqa: E402
from megazero.watchdog import configure_watchdog  # noqa: E402

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
configure_watchdog(WatchdogConfig(enabled=True, timeout=float(sys.argv[1])))
rank = dist.get_rank()
links = StageLinks([0, 1], rank, dist.group.WORLD, torch.float32, torch.device("cpu"), transport="shm")
print(f"rank {rank}: links through shared memory with {sorted(links.shm)}", flush=True)
links.recv_backward() if rank == 0 else links.recv_forward()
