"""Two ranks that each wait in a watched operation for the other, which never comes:
`torchrun --nproc_per_node=2 stuck_stages.py TIMEOUT CASE`. The watchdog must see every rank
waiting and exit.

CASE shm: two pipeline stages each wait, through the shared-memory transport, for a message the
other never sends (the main threads sleep in poll() inside StageLinks' watched calls).
CASE end_barrier: rank 1 reaches the recipe's end-of-run barrier while rank 0 still waits for a
message rank 1 never sends (as when a rank skips work whose collectives its peers run)."""

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

timeout, case = float(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
configure_watchdog(WatchdogConfig(enabled=True, timeout=timeout))
rank = dist.get_rank()
links = StageLinks([0, 1], rank, dist.group.WORLD, torch.float32, torch.device("cpu"),
                   transport="shm" if case == "shm" else "backend")
if case == "shm":
    print(f"rank {rank}: links through shared memory with {sorted(links.shm)}", flush=True)
    links.recv_backward() if rank == 0 else links.recv_forward()
else:
    print(f"rank {rank}: {'waiting for a message' if rank == 0 else 'at the end of the run'}", flush=True)
    links.recv_backward() if rank == 0 else end_of_run_barrier()
