"""Start torch.distributed from whatever launched us: torchrun, then MPI, then Slurm, else one process."""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megazero.watchdog import watched


@dataclass
class LaunchEnv:
    """Where this process sits, as read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "mpi", "slurm" or "none"


def expand_first_host(nodelist: str) -> str:
    """First host of a Slurm node list: 'node[01-04,07],gpu2' -> 'node01'; 'a,b' -> 'a'."""
    nodelist = nodelist.strip()
    if not nodelist:
        raise ValueError("empty Slurm node list")
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    prefix, _, ranges = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _env_int(env: dict, *names: str) -> int | None:
    for name in names:
        if env.get(name, "") != "":
            return int(env[name])
    return None


def detect_launch_env(env: dict | None = None) -> LaunchEnv:
    """Read rank/world/master from torchrun's, MPI's or Slurm's variables (in that order)."""
    env = dict(os.environ if env is None else env)
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = int(env.get("MASTER_PORT", "29500"))
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         addr, port, "torchrun")
    rank = _env_int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    if rank is not None:
        world = _env_int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
        local = _env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID") or 0
        return LaunchEnv(rank, world, local, addr, port, "mpi")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        if "MASTER_ADDR" not in env:
            addr = expand_first_host(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "127.0.0.1"))
        if "MASTER_PORT" not in env:
            # a fixed port collides between jobs sharing a node; derive one from the job id
            port = 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                         addr, port, "slurm")
    return LaunchEnv(0, 1, 0, addr, port, "none")


BACKEND_ENV = "MEGAZERO_DIST_BACKEND"  # e.g. gloo: tests on a GPU host, CPU runs beside a GPU job


def select_device_index(local_rank: int, device_count: int) -> int:
    """The GPU (an index among the visible ones) a rank uses: local_rank % device_count.

    Under `srun --gpus-per-task=1` or `--gpu-bind`, each rank sees only its own GPU(s), as index 0
    up, while its local rank counts the node's tasks; with more ranks than visible GPUs, ranks
    share them in turn. Either way the local rank alone is not a valid device ordinal."""
    if device_count < 1:
        raise ValueError(f"select_device_index: no visible GPU (device_count {device_count}) for local rank "
                         f"{local_rank}")
    if local_rank < 0:
        raise ValueError(f"select_device_index: local rank must be >= 0, got {local_rank}")
    return local_rank % device_count


def training_device(local_rank: int | None = None, device_count: int | None = None) -> torch.device:
    """Where this rank trains: cuda:(local_rank % device_count) when there is a GPU, else the CPU.
    local_rank defaults to the launcher's, device_count to the GPUs this process sees."""
    if device_count is None:
        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_count == 0:
        return torch.device("cpu")
    if local_rank is None:
        local_rank = detect_launch_env().local_rank
    return torch.device("cuda", select_device_index(local_rank, device_count))


def resolve_backend(dist_backend: str | None = None, env: dict | None = None,
                    cuda_available: bool | None = None) -> str:
    """The process-group backend: `dist_backend` if given, else $MEGAZERO_DIST_BACKEND, else NCCL
    when CUDA is available and gloo otherwise. Asking for NCCL without CUDA is an error."""
    env = os.environ if env is None else env
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
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
        torch.cuda.set_device(training_device(launch.local_rank))
    if launch.launcher == "none" and init_method is None:
        # a lone process needs no rendezvous (and must not collide on a port with other jobs)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, init_method=init_method or "env://", rank=launch.rank,
                                world_size=launch.world_size, timeout=timeout)
    return launch


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
