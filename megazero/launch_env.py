"""Where this process sits in the job, read from the launcher's environment: torchrun's variables,
then MPI's (Open MPI, MPICH/Intel MPI), then Slurm's, else one lone process."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass


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
