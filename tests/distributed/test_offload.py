"""Optimizer offload to NVMe (megazero.zero.offload): bit for bit the in-memory run of the same
stage at DP=1 and DP=2, stages 1-3, fp32 and bf16, with gradient accumulation, clipping and
dropout; checkpoints load with offload off and on; swap files are per run and rank, removed at
exit, never read when stale; `device: cpu` on CPU is the in-memory path (nothing copied twice)."""

from __future__ import annotations

import errno
import gc
import json
import os
import resource
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megazero.ops.aio import AsyncIO
from megazero.profiling.memory import estimate_zero_memory, tensor_bytes
from megazero.zero.swap import OWNER_FILE, ROOT_NAME, StaleSwapError, SwapDirectory, SwapFiles
from tests.training_helpers import base_config, build_engine, full_parameters, global_mean, train

STEPS = 2  # the second step reads back what the first wrote


def _config(stage: int, bf16: bool, offload: dict | None = None, sub_group_size: int = 30000) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 100}
    if offload is not None:  # 30000: several sub-groups of whole master chunks
        zero.update(sub_group_size=sub_group_size, offload_optimizer=offload)
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    return base_config(zero_optimization=zero, gradient_accumulation_steps=2, **extra)


def _equal(a: dict, b: dict, losses: bool = True) -> bool:
    same = all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    return same and (not losses or a["losses"] == b["losses"])


def _swap_root(tmp: str) -> str:
    return os.path.join(tmp, ROOT_NAME)


def _same_as_in_memory(prefix: str, tmp: str, cases: list[tuple[int, bool]], checkpoints: bool) -> dict:
    """Per (stage, bf16): offloaded == in-memory; with `checkpoints`, a checkpoint of an offloaded
    run continued with offload off, and one of an in-memory run continued offloaded (last case)."""
    rank = dist.get_rank()
    nvme = {"device": "nvme", "nvme_path": os.path.join(tmp, "nvme")}
    out = {}
    for stage, bf16 in cases:
        plain = train(_config(stage, bf16), prefix, STEPS)
        offloaded = train(_config(stage, bf16, nvme), prefix, STEPS)
        out[f"stage{stage}-{'bf16' if bf16 else 'fp32'}"] = _equal(plain, offloaded)
    stage, bf16 = cases[-1]
    saves = {} if not checkpoints else {name: os.path.join(tmp, f"ckpt-{name}") for name in ("plain", "offloaded")}
    if checkpoints:
        _crossed_checkpoints(prefix, saves, stage, bf16, nvme, out)
    gc.collect()
    root = _swap_root(nvme["nvme_path"])
    out["swap removed"] = not os.path.isdir(root) or os.listdir(root) == []
    out["rank"] = rank
    return out


def _crossed_checkpoints(prefix: str, saves: dict, stage: int, bf16: bool, nvme: dict, out: dict) -> None:
    full = train(_config(stage, bf16), prefix, STEPS + 1, save_dir=saves["plain"], save_at=STEPS - 1)
    train(_config(stage, bf16, nvme), prefix, STEPS - 1, save_dir=saves["offloaded"], save_at=STEPS - 1)
    out["offloaded ckpt, offload off"] = _equal(full, train(_config(stage, bf16), prefix, STEPS + 1,
                                                            load_dir=saves["offloaded"]), losses=False)
    out["in-memory ckpt, offloaded"] = _equal(full, train(_config(stage, bf16, nvme), prefix, STEPS + 1,
                                                          load_dir=saves["plain"]), losses=False)


def _device_cpu_and_accounting(prefix: str, tmp: str) -> dict:
    """device cpu on CPU is the in-memory engine itself; nvme's RAM and disk per rank against
    estimate_zero_memory."""
    out = {}
    for bf16 in (False, True):
        plain, _ = build_engine(_config(2, bf16), prefix)
        cpu, _ = build_engine(_config(2, bf16, {"device": "cpu"}), prefix)
        for engine in (plain, cpu):
            engine.train_batch(iter(engine.training_dataloader))
        masters = [m for g in cpu.optimizer.param_groups for m in g["params"]]
        own = [v for part in cpu.dp.parts for v in part.layout.own_chunks(part.flat_params, part.rank)]
        out[f"cpu is in-memory {bf16}"] = (type(cpu.dp) is type(plain.dp) and cpu.optimizer.__class__ is
                                           plain.optimizer.__class__ and cpu.memory_report()["total"] ==
                                           plain.memory_report()["total"])
        if not bf16:  # fp32: the masters are the model's own partitions, not copies
            out["fp32 masters alias params"] = [m.data_ptr() for m in masters] == [v.data_ptr() for v in own]
    nvme = {"device": "nvme", "nvme_path": os.path.join(tmp, "nvme-acct")}
    # one sub-group (the estimate cannot know where buckets close, so how many chunks fill a sub-group)
    engine, loader = build_engine(_config(3, True, nvme, sub_group_size=10**9), prefix)
    data = iter(loader)
    for _ in range(2):  # the first step makes the optimizer states; the second sizes the buffers for them
        engine.train_batch(data)
    held = engine.dp.memory_tensors()
    psi = sum(shape.numel() for shape in engine.dp.parameter_shapes().values())  # stage 3: params are empty
    estimate = estimate_zero_memory(psi, dist.get_world_size(), 3, "bf16", "adam",
                                    offload_optimizer="nvme", sub_group_size=10**9, buffer_count=4,
                                    reduce_bucket_size=20000)
    out["disk"] = (engine.dp.disk_bytes(), estimate["disk"])
    out["buffers"] = (tensor_bytes(held["optimizer"]), estimate["optimizer_states"])
    # the gradient partitions are on disk: memory holds the step's read and backward's write buffers
    out["gradient buffers"] = (tensor_bytes(held["gradients"]), estimate["gradients"])
    out["accumulated by read-add-write"] = engine.dp.grads.reads_for_accumulation > 0
    engine.dp.close()
    out["nonfinite"] = _nonfinite_names(prefix, tmp)
    return out


def _nonfinite_names(prefix: str, tmp: str) -> list[list[str]]:
    """The parameters each state names for an inf in one gradient, and its global norm: in memory,
    then with the gradients swapped (noted as they were written)."""
    out = []
    for offload in (None, {"device": "nvme", "nvme_path": os.path.join(tmp, "nvme-inf")}):
        engine, loader = build_engine(_config(3, False, offload), prefix)
        names = {id(p): n for n, p in engine.module.named_parameters()}
        target = dict(engine.module.named_parameters())["blocks.0.mlp.fc.weight"]

        def poison(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            grad.view(-1)[7] = float("inf")
            return grad

        handle = target.register_hook(poison)
        batch = next(iter(loader))
        engine.backward(engine(**batch))
        engine.dp.reduce_gradients()
        handle.remove()
        out.append([names[id(p)] for p in engine.dp.nonfinite_params()] + [str(engine.dp.grad_norm())])
        if offload is not None:
            engine.dp.close()
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_offloaded_runs_equal_in_memory_runs(pools, token_dataset_prefix_module, tmp_path, world_size):
    """Bit for bit: stages 1-3, each in fp32 at one world size and bf16 at the other, accumulation
    2, clipping on, dropout 0.1; at DP=2 checkpoints cross offload on/off."""
    cases = [(1, False), (2, True), (3, True)] if world_size == 2 else [(1, True), (2, False), (3, False)]
    for result in pools(world_size).run(_same_as_in_memory, token_dataset_prefix_module, str(tmp_path), cases,
                                        world_size == 2):
        failed = [k for k, v in result.items() if v is False]
        assert not failed, f"rank {result['rank']}: {failed}"


def test_device_cpu_copies_nothing_and_nvme_matches_estimate(pools, token_dataset_prefix_module, tmp_path):
    (result,) = pools(1).run(_device_cpu_and_accounting, token_dataset_prefix_module, str(tmp_path))
    assert result["cpu is in-memory False"] and result["cpu is in-memory True"]
    assert result["fp32 masters alias params"]
    measured, estimated = result["disk"]
    assert abs(measured - estimated) <= 0.1 * estimated, result["disk"]
    measured, estimated = result["buffers"]
    assert abs(measured - estimated) <= 0.1 * estimated, result["buffers"]
    measured, estimated = result["gradient buffers"]
    assert abs(measured - estimated) <= 0.1 * estimated, result["gradient buffers"]
    assert result["accumulated by read-add-write"]
    in_memory, swapped = result["nonfinite"]
    assert in_memory == swapped and in_memory[-1] == "inf" and "blocks.0.mlp.fc.weight" in in_memory


def test_swap_files_are_per_run_removed_at_exit_and_never_read_stale(tmp_path):
    """A run that fails with an exception leaves no swap directory; a dead run's directory that is
    still there (killed) is removed at start-up; a file that is not this run's is never read."""
    code = ("import os, torch; from megazero.ops.aio import AsyncIO; from megazero.zero.swap import *\n"
            f"f = SwapFiles(SwapDirectory({str(tmp_path)!r}, 'failed-run', 0), AsyncIO())\n"
            "f.wait(f.submit_write('x', torch.ones(5000))); print(os.getpid(), flush=True)\n"
            "raise RuntimeError('the training step failed')\n")
    failed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "the training step failed" in failed.stderr
    assert os.listdir(tmp_path / ROOT_NAME) == []
    killed = tmp_path / ROOT_NAME / "killed-run" / "rank0"  # as SIGKILL leaves it: owner pid gone
    killed.mkdir(parents=True)
    (killed / OWNER_FILE).write_text(json.dumps({"run_id": "killed-run", "rank": 0, "host": os.uname().nodename,
                                                 "pid": int(failed.stdout)}))
    (killed / "optimizer00000.swp").write_bytes(b"stale")
    with pytest.warns(UserWarning, match="stale swap"):
        directory = SwapDirectory(tmp_path, "new-run", 0)
    assert not killed.exists()
    with pytest.raises(FileExistsError, match="not new"):
        SwapDirectory(tmp_path, "new-run", 0)
    files = SwapFiles(directory, AsyncIO())
    data = torch.arange(3000, dtype=torch.float32)
    files.wait(files.submit_write("a", data))
    back = torch.empty_like(data)
    files.wait(files.submit_read("a", back))
    assert torch.equal(back, data)
    with pytest.raises(StaleSwapError, match="never written by this run"):
        files.submit_read("b", back)
    # another run's file in its place (same name, same size): its header names the other run
    other = SwapFiles(SwapDirectory(tmp_path, "other-run", 0), AsyncIO())
    other.wait(other.submit_write("a", data))
    os.replace(other.directory.file("a"), directory.file("a"))
    with pytest.raises(StaleSwapError, match="does not belong to this run"):
        files.submit_read("a", back)
    files.close()
    other.close()
    assert os.listdir(tmp_path / ROOT_NAME) == []


def _gradient_ring(prefix: str, tmp: str) -> dict:
    """Stages 2 and 3: reduced gradient chunks stay in backward's ring until it needs their place.
    A partition that fits (a large buffer_count) is never written nor read back; one that does not
    has its chunks written as they are evicted, and the step takes those still in the ring from
    memory. Both equal the in-memory run bit for bit (accumulation 2, clipping, dropout)."""
    out = {}
    for stage in (2, 3):
        plain = train(_config(stage, True), prefix, STEPS)
        for buffer_count in (64, 2):
            nvme = {"device": "nvme", "nvme_path": os.path.join(tmp, f"nvme-ring{buffer_count}"),
                    "buffer_count": buffer_count}
            engine, loader = build_engine(_config(stage, True, nvme), prefix)
            data, losses = iter(loader), []
            for _ in range(STEPS):
                losses.append(global_mean(engine.train_batch(data).item(), engine))
            grads = engine.dp.grads
            chunks = sum(len(sg.chunks) for sg in engine.dp.groups)
            names = os.listdir(engine.dp.files.directory.path)
            case = f"stage{stage} buffer_count {buffer_count}"
            out[f"{case}: equal"] = _equal(plain, {"losses": losses, "params": full_parameters(engine)})
            if buffer_count == 64:
                out[f"{case}: no gradient file"] = (not any(n.startswith("gradients") for n in names)
                                                    and grads.chunks_written == grads.chunks_read == 0)
            else:  # every micro-batch reduces every chunk; some never reach the disk
                out[f"{case}: evicted, some kept"] = 0 < grads.chunks_written < STEPS * 2 * chunks
            engine.dp.close()
    out["rank"] = dist.get_rank()
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_gradient_chunks_stay_in_the_ring_until_evicted(pools, token_dataset_prefix_module, tmp_path, world_size):
    for result in pools(world_size).run(_gradient_ring, token_dataset_prefix_module, str(tmp_path)):
        failed = [k for k, v in result.items() if v is False]
        assert not failed, f"rank {result['rank']}: {failed}"


def _states(optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]


def _deferred_io(prefix: str, tmp: str) -> dict:
    """A step leaves its write-backs and the next step's reads in flight; a checkpoint saved right
    after it holds the stepped state, a load after it is what the next step reads; a write-back that
    fails raises at the next step with the path, before anything is stepped, and loses nothing."""
    out = {}
    nvme = {"device": "nvme", "nvme_path": os.path.join(tmp, "nvme-deferred")}
    config = _config(1, True, nvme, sub_group_size=10**9)  # fewer sub-groups than buffers: all deferred
    plain, plain_loader = build_engine(_config(1, True), prefix)
    engine, loader = build_engine(config, prefix)
    plain_data, data = iter(plain_loader), iter(loader)
    for _ in range(2):
        plain.train_batch(plain_data)
        engine.train_batch(data)
    out["left in flight"] = bool(engine.dp._deferred) and bool(engine.dp._early)
    engine.save_checkpoint(os.path.join(tmp, "ckpt-deferred"))  # right after the step
    saved = [v.clone() for v in _states(engine.optimizer)]
    out["saved the stepped state"] = all(torch.equal(a, b) for a, b in zip(saved, _states(plain.optimizer)))
    engine.load_checkpoint(os.path.join(tmp, "ckpt-deferred"))  # rewrites the files the early reads read
    plain.train_batch(plain_data)
    engine.train_batch(data)
    i = next(iter(engine.dp._deferred))  # (a sub-group whose write-back is left in flight)
    out["step after save and load"] = all(torch.equal(a, b) for a, b in zip(_states(engine.optimizer),
                                                                          _states(plain.optimizer)))
    plain.train_batch(plain_data)  # (the check above made everything resident: early reads dropped)
    engine.train_batch(data)
    # the next write-backs fail: a file-size limit below their offsets (EFBIG; the header still reads)
    path = engine.dp.files.directory.file(engine.dp.groups[i].name)
    engine.dp.finish_io(keep_early_reads=True)  # (the last step's writes land before the limit)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        plain.train_batch(plain_data)
        engine.train_batch(data)  # (its write-backs are left in flight: the failure shows at the next use)
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        try:
            engine.train_batch(data)
            out["failed write raised"] = False
        except OSError as e:
            out["failed write raised"] = e.filename == path and e.errno == errno.EFBIG
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    out["weights untouched"] = all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
    engine.dp.finish_io()  # written again from its buffer
    out["nothing lost"] = all(torch.equal(a, b) for a, b in zip(_states(engine.optimizer), _states(plain.optimizer)))
    engine.dp.close()
    return out


def test_deferred_write_backs_and_early_reads(pools, token_dataset_prefix_module, tmp_path):
    (result,) = pools(1).run(_deferred_io, token_dataset_prefix_module, str(tmp_path))
    assert all(result.values()), result
