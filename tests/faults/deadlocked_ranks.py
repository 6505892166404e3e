"""Two ranks that wait for each other forever, as an NCCL job would: `torchrun --nproc_per_node=2
deadlocked_ranks.py TIMEOUT`.

Each rank posts a receive that no rank sends to (a lost message) and marks it for the watchdog the
way Handle.wait does; the mark ends at once, with the receive still incomplete, as NCCL's
Work.wait() returns before the collective is done. The main thread then blocks elsewhere (as the
CPU does at NCCL's next host synchronisation). Both watchdogs must see every rank waiting and exit.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megazero.config import WatchdogConfig  # noqa: E402
from megazero.watchdog import configure_watchdog  # noqa: E402

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
watchdog = configure_watchdog(WatchdogConfig(enabled=True, timeout=float(sys.argv[1])))
peer = 1 - dist.get_rank()
received = dist.irecv(torch.zeros(4), src=peer)
mark = watchdog.begin(f"p2p recv from rank {peer}", [received])
watchdog.end(mark)
print(f"rank {dist.get_rank()}: receive pending: {not received.is_completed()}", flush=True)
time.sleep(300)
