"""Start torch.distributed from whatever launched us: torchrun, then MPI, then Slurm, else one process."""

from __future__ import annotations

import atexit
import datetime
import os
import time

import torch
import torch.distributed as dist

from megazero.accelerator import get_accelerator, select_device_index, training_device
from megazero.launch_env import LaunchEnv, detect_launch_env, expand_first_host
from megazero.watchdog import watched

__all__ = ["BACKEND_ENV", "LaunchEnv", "all_reduce_sum", "all_reduce_values", "default_backend", "detect_launch_env",
           "expand_first_host", "init_distributed", "resolve_backend", "select_device_index", "training_device"]


BACKEND_ENV = "MEGAZERO_DIST_BACKEND"  # e.g. gloo: tests on a GPU host, CPU runs beside a GPU job
SETTLE_AT_EXIT_S = 0.1  # how long the GIL is free at exit for the collectives' threads to finish


def resolve_backend(dist_backend: str | None = None, env: dict | None = None,
                    cuda_available: bool | None = None) -> str:
    """The process-group backend: `dist_backend` if given, else $MEGAZERO_DIST_BACKEND, else the
    accelerator's (megazero.accelerator: NCCL on CUDA, gloo on the CPU). Asking for NCCL without CUDA
    is an error."""
    env = os.environ if env is None else env
    if cuda_available is None:  # the accelerator's choice (DS_ACCELERATOR=cpu keeps a GPU host on gloo)
        cuda_available = get_accelerator().device_name() == "cuda"
    backend = dist_backend or env.get(BACKEND_ENV, "") or ("nccl" if cuda_available else "gloo")
    backend = backend.strip().lower()
    if backend == "nccl" and not cuda_available:
        source = "dist_backend" if dist_backend else BACKEND_ENV if env.get(BACKEND_ENV) else "the default"
        raise ValueError(f"backend 'nccl' (from {source}) needs CUDA, but torch.cuda.is_available() is False; "
                         f"use 'gloo' (e.g. {BACKEND_ENV}=gloo)")
    return backend


def default_backend() -> str:
    """$MEGAZERO_DIST_BACKEND if set, else NCCL when CUDA is available, gloo otherwise."""
    return resolve_backend()


def init_distributed(dist_backend: str | None = None, timeout: datetime.timedelta | float = 1800.0,
                     init_method: str | None = None) -> LaunchEnv:
    """Initialise the default process group from the launcher's environment (no-op if already done).

    The backend is `dist_backend`, else $MEGAZERO_DIST_BACKEND, else NCCL on a CUDA host (gloo
    otherwise); under NCCL the current GPU becomes training_device()'s (local rank modulo the
    visible GPUs). A single process with no launcher variables becomes world size 1. `timeout`
    (seconds or a timedelta) bounds every collective, so a dead rank makes the others fail
    instead of hang.
    """
    launch = detect_launch_env()
    if dist.is_initialized():
        return launch
    backend = resolve_backend(dist_backend)
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    for key, value in (("RANK", launch.rank), ("WORLD_SIZE", launch.world_size),
                       ("LOCAL_RANK", launch.local_rank), ("MASTER_ADDR", launch.master_addr),
                       ("MASTER_PORT", launch.master_port)):
        os.environ.setdefault(key, str(value))
    if backend == "nccl":
        get_accelerator().set_device(training_device(launch.local_rank).index)
    if launch.launcher == "none" and init_method is None:
        # a lone process needs no rendezvous (and must not collide on a port with other jobs)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, init_method=init_method or "env://", rank=launch.rank,
                                world_size=launch.world_size, timeout=timeout)
    settle_collectives_at_exit()
    return launch


_SETTLE_REGISTERED = False


def settle_collectives_at_exit() -> None:
    """Make the interpreter's exit wait a moment for the collectives' threads (once per process;
    init_distributed and megazero.initialize call it)."""
    global _SETTLE_REGISTERED
    if not _SETTLE_REGISTERED:
        atexit.register(_let_collectives_settle_at_exit)
        _SETTLE_REGISTERED = True


def _let_collectives_settle_at_exit() -> None:
    """Release the GIL for a moment before the interpreter finalises. A gloo worker thread drops
    its finished collective's tensors just after the waiter wakes, which takes the GIL; at
    finalisation a thread that asks for the GIL is made to exit, and unwinding through the C++
    frames aborts the process ("terminate called without an active exception") after a run that
    otherwise succeeded (seen on DeepSpeed's CIFAR-10 tutorial, which ends without
    destroy_process_group)."""
    if dist.is_initialized():
        time.sleep(SETTLE_AT_EXIT_S)


@watched("all-reduce of values")
def all_reduce_values(values: list[float], op: str = "sum", group=None) -> list[float]:
    """All-reduce a few Python floats (float64) over `group`; works on gloo and NCCL alike."""
    device = torch.device("cpu")
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        dist.all_reduce(t, op=ops[op], group=group)
    return t.tolist()


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a tensor over `group`, leaving it on the device (no read-back: the caller reads it once);
    under NCCL a CPU tensor is first moved to the current GPU, where NCCL needs it."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    if dist.get_backend(group) == "nccl" and t.device.type != "cuda":
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    else:
        t = t.clone()  # the caller's tensor stays as it was
    dist.all_reduce(t, group=group)
    return t
