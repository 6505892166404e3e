"""Parameter offload's GPU path (megazero.zero.param_offload over megazero.zero.staging), what only a
GPU proves (tests/distributed/test_param_offload.py covers the staging logic on the CPU with a forced
copy): on one GPU over NCCL, stage 3 bf16 with accumulation, clipping and dropout, offload_param
`device: cpu` (partitions in pinned host memory) and `device: nvme` (swap files read into pinned pool
buffers) train bit for bit as in-memory stage 3; between uses every partition is in host memory
(pinned where it stays there), during its unit's forward the parameters are whole on the GPU, and
no staged copy outlives its gather. Skipped without a GPU; the run is its own process (fresh CUDA and
process group)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, repo_pythonpath

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.version.cuda is None or not torch.cuda.is_available(),
                                 reason="needs a GPU and a CUDA build of torch (this is a CPU run)")]


SCRIPT = r"""
import json, os, torch, megazero
from models.gpt import GPTConfig
from models.parallelize import parallelize
from tests.training_helpers import TINY, base_config, full_parameters

megazero.init_distributed()
STEPS, MICRO, ACCUMULATION = 3, 4, 2


def run(offload):
    zero = {"stage": 3, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 100}
    if offload is not None:
        zero["offload_param"] = offload
    config = base_config(zero_optimization=zero, bf16={"enabled": True}, gradient_accumulation_steps=ACCUMULATION)
    megazero.set_seed(0)
    engine, *_ = megazero.initialize(model=parallelize(GPTConfig(**TINY)).cuda(), config=config)
    state = getattr(engine.dp, "inner", engine.dp)
    swap = state.param_swap
    during = []  # as each unit's forward starts: its partitions on the host, its parameters whole on the GPU
    if swap is not None:
        for unit in state.units:
            split = [s for s in unit.shards if not s.persistent]
            if split:  # (after the engine's pre-hook, which gathers the unit)
                unit.module.register_forward_pre_hook(lambda m, a, split=split: during.append(all(
                    s.shard.device.type == "cpu" and s.full is not None and s.full.is_cuda for s in split)))
    g = torch.Generator().manual_seed(0)
    losses, between = [], []
    for _ in range(STEPS):
        batches = []
        for _ in range(ACCUMULATION):
            ids = torch.randint(0, TINY["vocab_size"], (MICRO, TINY["seq_length"] + 1), generator=g)
            batches.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
        losses.append(engine.train_batch(iter(batches)).item())
        if swap is not None:
            torch.cuda.synchronize()
            split = [s for s in state.parts if not s.persistent]
            resident = [s for s in split if s.shard.untyped_storage().nbytes() > 0]
            between.append({"on host": all(s.shard.device.type == "cpu" for s in split),
                            "released": all(s.full is None for s in split),
                            "pinned": all(s.shard.is_pinned() for s in resident),
                            "resident": len(resident), "partitions": len(split),
                            "staged live": swap.staging.live})
    out = {"losses": losses, "params": {k: v.cpu() for k, v in full_parameters(engine).items()}}
    if swap is not None:
        out.update(during=during, between=between, copies=swap.staging.copies, identity=swap.staging.identity,
                   pool_pinned=swap.pool.pin, reads=swap.reads)
        swap.close()
    return out


plain = run(None)
report = {}
for name, offload in (("cpu", {"device": "cpu", "pin_memory": True}),
                      ("nvme", {"device": "nvme", "nvme_path": os.environ["NVME_PATH"], "pin_memory": True,
                                "max_in_cpu": 0})):
    r = run(offload)
    report[name] = {"equal losses": r["losses"] == plain["losses"],
                    "equal params": all(torch.equal(r["params"][k], plain["params"][k]) for k in plain["params"]),
                    "losses": (r["losses"], plain["losses"]), "during": bool(r["during"]) and all(r["during"]),
                    "between": r["between"], "copies": r["copies"], "identity": r["identity"],
                    "pool pinned": r["pool_pinned"], "reads": r["reads"]}
print("REPORT " + json.dumps(report))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_param_offload_on_gpu_equals_in_memory_and_keeps_partitions_on_host(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=repo_pythonpath(env), MEGAZERO_DIST_BACKEND="nccl", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), NVME_PATH=str(tmp_path / "nvme"))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("REPORT "))[7:])
    for name, r in report.items():
        assert r["equal losses"] and r["equal params"], (name, r["losses"])
        assert not r["identity"] and r["copies"] > 0 and r["during"], (name, r)
        for b in r["between"]:  # after every step: on the host, nothing whole, no staged copy held
            assert b["on host"] and b["released"] and b["pinned"] and b["staged live"] == 0, (name, b)
    assert all(b["resident"] == b["partitions"] > 0 for b in report["cpu"]["between"]), report["cpu"]
    assert report["cpu"]["reads"] == 0, report["cpu"]
    nvme = report["nvme"]
    assert nvme["pool pinned"] and nvme["reads"] > 0 and all(b["resident"] == 0 for b in nvme["between"]), nvme
