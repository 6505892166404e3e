"""Launcher environment detection: torchrun, MPI, Slurm, none."""

from __future__ import annotations

import pytest

from megazero.distributed import detect_launch_env, expand_first_host


@pytest.mark.parametrize("nodelist, first", [
    ("node01", "node01"), ("node[01-04,07]", "node01"), ("gpu[3,5-6],cpu1", "gpu3"), ("a,b", "a"),
    ("n[007-009]", "n007"),
])
def test_first_host(nodelist, first):
    assert expand_first_host(nodelist) == first


def test_torchrun_wins():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    launch = detect_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master_addr, launch.master_port,
            launch.launcher) == (3, 8, 1, "h", 1234, "torchrun")


def test_openmpi_and_mpich():
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "MASTER_ADDR": "m"}
    launch = detect_launch_env(env)
    assert (launch.rank, launch.world_size, launch.launcher, launch.master_addr) == (2, 4, "mpi", "m")
    launch = detect_launch_env({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (launch.rank, launch.world_size, launch.local_rank) == (1, 2, 0)


def test_slurm_master_from_nodelist_and_port_from_job_id():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "cn[12-13]", "SLURM_JOB_ID": "123456"}
    launch = detect_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.launcher) == (5, 8, 1, "slurm")
    assert launch.master_addr == "cn12" and launch.master_port == 20000 + 123456 % 20000
    other = detect_launch_env({**env, "SLURM_JOB_ID": "123457"})
    assert other.master_port != launch.master_port


def test_no_launcher_is_one_process():
    launch = detect_launch_env({})
    assert (launch.rank, launch.world_size, launch.launcher) == (0, 1, "none")
