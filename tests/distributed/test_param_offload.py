"""Parameter offload at ZeRO stage 3 (megazero.zero.param_offload): with offload_param nvme the
partitioned parameters live in swap files, are read back ahead of use and dropped after; the run is
bit for bit the in-memory stage-3 run at DP=1 and DP=2, fp32 and bf16, with accumulation, clipping
and dropout (per world size one dtype alone, the other with offload_optimizer nvme too and some
partitions cached), also for a model zero.Init built straight into swap files (holding nothing);
the partitions held in memory stay under three partitions' worth (the unit gathered, the next
one and the one read ahead); a partition is read ahead one unit before its gather starts; device
cpu on CPU is the in-memory path. Also: after each optimizer step the persistent parameters are
re-gathered in one all-gather per reduce bucket, not one per unit."""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist

import megazero
from megazero.data import GPTDataset, IndexedDataset
from megazero.profiling.memory import engine_memory_report, estimate_zero_memory, tensor_bytes
from megazero.zero import Init
from megazero.zero.collectives import traffic
from megazero.zero.persistent import _packs
from megazero.zero.swap import ROOT_NAME
from models.gpt import GPTConfig
from models.parallelize import parallelize
from tests.training_helpers import TINY, base_config, build_engine, full_parameters, global_mean, train

STEPS = 2  # the second step reads back what the first step's update wrote


def _config(bf16: bool, offload_param: dict | None = None, offload_optimizer: dict | None = None) -> dict:
    zero = {"stage": 3, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 100}
    if offload_param is not None:
        zero["offload_param"] = offload_param
    if offload_optimizer is not None:
        zero["offload_optimizer"] = offload_optimizer
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    return base_config(zero_optimization=zero, gradient_accumulation_steps=2, **extra)


def _equal(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def _param_state(engine):
    return getattr(engine.dp, "inner", engine.dp)


def _init_on_nvme(prefix: str, tmp: str, nvme: dict, reference: dict) -> dict:
    """A model built by zero.Init straight into swap files holds nothing in memory, and trains with
    parameter offload exactly as the in-memory stage-3 run of the same model (`reference`, bf16)."""
    config = _config(True, nvme)
    megazero.set_seed(0)
    with Init(config_dict_or_path=config):
        model = parallelize(GPTConfig(**TINY), None)
    held = sum(p.numel() + getattr(p, "_megazero_init_chunk", torch.empty(0)).numel() for p in model.parameters())
    swapped = all(hasattr(p, "_megazero_init_swap") for p in model.parameters())
    init_dir = next(iter(model.parameters()))._megazero_init_swap[0].files.directory.path
    engine, _, loader, _ = megazero.initialize(model=model, training_data=GPTDataset(
        IndexedDataset(prefix), TINY["seq_length"], seed=0), config=config)
    del model
    gc.collect()
    swap = engine.dp.param_swap
    largest_unit = max(sum(s.shard.numel() for s in u.shards if not s.persistent) for u in engine.dp.units)
    data = iter(loader)
    losses = [global_mean(engine.train_batch(data).item(), engine) for _ in range(STEPS)]
    result = {"losses": losses, "params": full_parameters(engine)}
    return {"held after Init": held, "in swap files": swapped, "Init files removed": not os.path.exists(init_dir),
            "build peak within a unit": swap.setup_peak_numel <= largest_unit,
            "equal": _equal(reference, result)}


def _against_estimate(engine, state) -> dict:
    """(measured, estimate_zero_memory's) bytes of this rank after a step: parameters, gradients and
    optimizer states in memory, parameter swap files on disk (bf16, offload_param nvme, max_in_cpu 0)."""
    psi = sum(shape.numel() for shape in state.parameter_shapes().values())
    persistent = sum(p.numel() for s in state.parts if s.persistent for p in s.layout.params)
    estimate = estimate_zero_memory(psi, dist.get_world_size(), 3, "bf16", "adamw", offload_param="nvme",
                                    max_in_cpu=0, persistent_params=persistent,
                                    param_swap_files=len(state.param_swap.shards))
    measured = engine_memory_report(engine)
    out = {key: (measured[key], estimate[key]) for key in ("parameters", "gradients", "optimizer_states")}
    out["disk"] = (state.param_swap.disk_bytes(), estimate["param_disk"])
    return out


def _offload_runs(prefix: str, tmp: str) -> dict:
    rank = dist.get_rank()
    nvme = {"device": "nvme", "nvme_path": os.path.join(tmp, "nvme"), "max_in_cpu": 0}
    out = {"rank": rank}
    for bf16 in (False, True):
        kind = "bf16" if bf16 else "fp32"
        plain = train(_config(bf16), prefix, STEPS)
        if bf16 == (dist.get_world_size() == 1):  # also: some partitions cached, the optimizer offloaded too
            offloaded = train(_config(bf16, {**nvme, "max_in_cpu": 5000},
                                      {"device": "nvme", "nvme_path": nvme["nvme_path"]}), prefix, STEPS)
        else:
            offloaded = train(_config(bf16, nvme), prefix, STEPS)
        out[f"{kind} equal"] = _equal(plain, offloaded)
    # plain: the bf16 in-memory run
    out["zero.Init on nvme"] = _init_on_nvme(prefix, tmp, nvme, plain)
    # memory: the partitions in memory during a step, against the in-memory run's
    plain, _ = build_engine(_config(True), prefix)
    offloaded, loader = build_engine(_config(True, nvme), prefix)
    cpu, _ = build_engine(_config(True, {"device": "cpu"}), prefix)
    data = iter(loader)
    state = _param_state(offloaded)
    swap = state.param_swap
    for _ in range(2):
        offloaded.train_batch(data)
    partitions = [s for s in state.parts if not s.persistent]
    largest = sorted((s.shard.numel() for s in partitions), reverse=True)[:swap.pool.count]
    out["peak resident"] = (swap.peak_resident_numel, sum(largest), sum(s.shard.numel() for s in partitions))
    out["resident after step"] = swap.resident_numel
    out["reads"] = swap.reads
    out["parameter bytes"] = (tensor_bytes(state.memory_tensors()["parameters"]),
                              tensor_bytes(plain.dp.memory_tensors()["parameters"]))
    out["disk"] = swap.disk_bytes()
    out["measured vs estimate"] = _against_estimate(offloaded, state)
    out["cpu is in-memory"] = cpu.dp.param_swap is None and type(cpu.dp) is type(plain.dp)
    # the buffer pool (offload_param buffer_count x buffer_size): reads land in reused buffers, each
    # the largest partition's bytes, no more in use than partitions resident; a too small
    # buffer_size is an error naming it
    pool = swap.pool
    out["pool"] = (pool.peak_in_use, pool.made, pool.count, pool.overflows,
                   pool.nbytes == max(s.shard.numel() * s.shard.element_size() for s in partitions))
    try:
        build_engine(_config(True, {**nvme, "buffer_size": 8}), prefix)
        out["buffer_size error"] = "no error"
    except ValueError as e:
        out["buffer_size error"] = str(e)
    # persistent parameters: one all-gather per pack (reduce_bucket_size), not one per unit
    persistent = [s for s in plain.dp.parts if s.persistent]
    traffic.reset()
    plain.dp.update_model()
    out["persistent gathers"] = (traffic.calls.get("all_gather", 0), len(_packs(persistent, 20000)), len(persistent))
    swap.close()
    del offloaded, plain, cpu, state, swap
    gc.collect()
    root = os.path.join(nvme["nvme_path"], ROOT_NAME)
    left = [os.path.join(d, r) for d in (os.listdir(root) if os.path.isdir(root) else [])
            for r in os.listdir(os.path.join(root, d))]
    out["swap left"] = left
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_param_offload_equals_in_memory_and_bounds_memory(pools, token_dataset_prefix_module, tmp_path, world_size):
    for r in pools(world_size).run(_offload_runs, token_dataset_prefix_module, str(tmp_path)):
        failed = [k for k, v in r.items() if v is False]
        assert not failed, f"rank {r['rank']}: {failed}"
        assert r["swap left"] == [], r["swap left"]  # every run's swap files removed with its engine
        init = r["zero.Init on nvme"]
        assert init == {"held after Init": 0, "in swap files": True, "Init files removed": True,
                        "build peak within a unit": True, "equal": True}, init
        peak, pooled, total = r["peak resident"]
        # never more than buffer_count partitions at once (max_in_cpu 0): in forward and backward
        # three (test_param_offload_reads_a_partition_one_unit_before_its_gather), in the update
        # the one cast and the writes in flight
        assert peak <= pooled < total, r["peak resident"]
        assert r["resident after step"] == 0 and r["reads"] > 0
        offloaded, in_memory = r["parameter bytes"]
        assert offloaded < in_memory, r["parameter bytes"]  # only the persistent ones stay
        assert r["disk"] > 0
        for kind, (measured, estimated) in r["measured vs estimate"].items():  # RAM and disk per rank
            assert abs(measured - estimated) <= 0.1 * estimated, (kind, r["measured vs estimate"])
        peak_buffers, made, count, overflows, sized = r["pool"]
        assert peak_buffers <= count and made <= count and overflows == 0 and sized, r["pool"]
        assert "offload_param.buffer_size=8 elements" in r["buffer_size error"], r["buffer_size error"]
        calls, packs, shards = r["persistent gathers"]
        if world_size > 1:
            assert calls == packs < shards, r["persistent gathers"]
        print(r)


def _read_ahead_order(prefix: str, tmp: str) -> dict:
    """The order of a step's events (after the first step, which learns the order) in forward: the
    read of each unit's partition is submitted, and each unit's forward returns. With the read
    ahead, the partition of the unit two places on in the prefetch order is submitted before this
    unit's forward has computed; without it, only once the next unit's forward starts."""
    nvme = {"device": "nvme", "nvme_path": os.path.join(tmp, "nvme"), "max_in_cpu": 0}
    engine, loader = build_engine(_config(True, nvme), prefix)
    data = iter(loader)
    engine.train_batch(data)
    state = _param_state(engine)
    order = [u for u in state.fetcher.order if u.numel > 0]
    position = {s.swap_name: i for i, u in enumerate(order) for s in u.shards if not s.persistent}
    events: list[tuple[str, int]] = []
    files = state.param_swap.files
    submit_read = files.submit_read

    def recording_read(name, *args, **kwargs):
        events.append(("read", position[name]))
        return submit_read(name, *args, **kwargs)

    files.submit_read = recording_read
    for i, unit in enumerate(order):
        unit.module.register_forward_hook(lambda mod, args, out, i=i: events.append(("computed", i)))
    swap = state.param_swap
    swap.reset_peak()
    update_model, before_update = state.update_model, {}

    def measured_update(*args, **kwargs):  # the partitions held in forward and backward
        before_update.update(resident=swap.peak_resident_numel, buffers=swap.pool.peak_in_use)
        return update_model(*args, **kwargs)

    state.update_model = measured_update
    write_back, in_flight = swap.write_back, []

    def counted_write_back(shard):  # write-backs left in flight as the next partitions are cast
        write_back(shard)
        in_flight.append(len(swap._writing))

    swap.write_back = counted_write_back
    engine.train_batch(data)
    first = {}
    for index, event in enumerate(events):
        first.setdefault(event, index)
    late = [j for j in range(2, len(order)) if first[("read", j)] > first[("computed", j - 2)]]
    pool = swap.pool
    largest_three = sum(sorted((s.shard.numel() for u in order for s in u.shards if not s.persistent),
                               reverse=True)[:3])
    return {"rank": dist.get_rank(), "units": len(order), "late": late, "read aheads": state.fetcher.read_aheads,
            "overflows": pool.overflows, "peak buffers": pool.peak_in_use, "buffer count": pool.count,
            "forward and backward": (before_update["resident"], largest_three, before_update["buffers"]),
            "writes in flight": (max(in_flight), in_flight[-1], swap.writes_in_flight)}


@pytest.mark.parametrize("world_size", [1, 2])
def test_param_offload_reads_a_partition_one_unit_before_its_gather(pools, token_dataset_prefix_module, tmp_path,
                                                                     world_size):
    """At DP>1 a gather waits for its partition's read before the all-gather starts (collectives
    start in the same order on every rank): the read is submitted one unit earlier, while the
    unit before the prefetched one computes, into a free buffer of the pool (never memory of its own).
    After the step, the write-backs of the updated partitions stay in flight (up to buffer_count - 1)
    while the next ones are cast, and all have landed when the update ends."""
    for r in pools(world_size).run(_read_ahead_order, token_dataset_prefix_module, str(tmp_path)):
        assert r["units"] >= 4, r
        assert r["late"] == [], r  # units whose read was submitted only after the unit two before computed
        assert r["read aheads"] > 0 and r["overflows"] == 0 and r["peak buffers"] <= r["buffer count"], r
        resident, largest_three, buffers = r["forward and backward"]
        # the unit gathered now, the next one's partition (prefetched) and the one after (read ahead)
        assert resident <= largest_three and buffers <= 3, r
        most, last, allowed = r["writes in flight"]
        assert allowed == r["buffer count"] - 1 and 1 < most <= allowed and last == 0, r  # all landed at the end


def _checkpoint_config(stage: int, offload: bool, tmp: str) -> dict:
    """Micro-batches of 2 at every DP size (accumulation makes up the rest), so that dropout masks
    follow a micro-batch from one layout to another (as test_zero_checkpoint)."""
    zero = {"stage": stage, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 100}
    if offload:
        nvme = os.path.join(tmp, "nvme")
        zero.update(offload_param={"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0},
                    offload_optimizer={"device": "nvme", "nvme_path": nvme}, sub_group_size=30000)
    return base_config(train_micro_batch_size_per_gpu=2, zero_optimization=zero)


CKPT_SAVE_AT, CKPT_STEPS = 1, 3


def _checkpoint_source(prefix: str, tmp: str) -> dict:
    """Stage 3 with parameters and optimizer offloaded to NVMe: saves at step 1, goes on to step 3;
    the same checkpoint continued with offload off (same layout) and at stage 2 (DP=2)."""
    save_dir = os.path.join(tmp, "ckpt")
    source = train(_checkpoint_config(3, True, tmp), prefix, CKPT_STEPS, save_dir=save_dir, save_at=CKPT_SAVE_AT)
    off = train(_checkpoint_config(3, False, tmp), prefix, CKPT_STEPS, load_dir=save_dir)
    stage2 = train(_checkpoint_config(2, False, tmp), prefix, CKPT_STEPS, load_dir=save_dir)
    gc.collect()
    root = os.path.join(tmp, "nvme", ROOT_NAME)
    return {"source": source, "offload off": off, "stage 2": stage2,
            "swap left": os.listdir(root) if os.path.isdir(root) else []}


def _continues(source: dict, target: dict, exact: bool) -> None:
    expected = source["losses"][CKPT_SAVE_AT:]
    assert len(target["losses"]) == len(expected), (expected, target["losses"])
    for name, value in source["params"].items():
        if exact:
            assert torch.equal(target["params"][name], value), name
        else:
            torch.testing.assert_close(target["params"][name], value, rtol=0, atol=2e-5, msg=name)
    if exact:
        assert target["losses"] == expected
    else:
        for a, b in zip(expected, target["losses"]):
            assert abs(a - b) <= 1e-5 * abs(a), (expected, target["losses"])


def test_param_offload_checkpoint_loads_without_offload_and_at_other_layouts(pools, token_dataset_prefix_module,
                                                                              tmp_path):
    """A checkpoint of a run with parameters and optimizer on NVMe (DP=2, stage 3) continues as the
    run itself: bit for bit with offload off at the same layout; to 1e-5 (summation order) at DP=2
    stage 2 and at DP=1 stage 3 offloaded again."""
    results = pools(2).run(_checkpoint_source, token_dataset_prefix_module, str(tmp_path))
    for r in results:
        assert r["swap left"] == [], r["swap left"]
        _continues(r["source"], r["offload off"], exact=True)
        _continues(r["source"], r["stage 2"], exact=False)
    (dp1,) = pools(1).run(train, _checkpoint_config(3, True, str(tmp_path / "dp1")), token_dataset_prefix_module,
                          CKPT_STEPS, 0, None, None, str(tmp_path / "ckpt"))
    _continues(results[0]["source"], dp1, exact=False)


def _built_with_staging(build, make):
    """build(), with `make` (a PartitionStaging factory) as param_offload.compute_staging."""
    from megazero.zero import param_offload

    original, param_offload.compute_staging = param_offload.compute_staging, make
    try:
        return build()
    finally:
        param_offload.compute_staging = original


def _staged_runs(prefix: str, tmp: str) -> dict:
    """The staging step to the compute device (megazero.zero.staging), run on the CPU with a forced
    copy into separate buffers, for both homes of the partitions: swap files (device nvme) and host
    memory (device cpu, as on a GPU). Each is bit for bit the in-memory run, copies every partition
    it gathers and holds none of the copies once a step ends; a plain CPU run's staging (pin_memory
    on: no effect without CUDA) is the identity and copies nothing."""
    from megazero.zero.staging import PartitionStaging

    plain = train(_config(True), prefix, STEPS)
    nvme = {"device": "nvme", "nvme_path": os.path.join(tmp, "nvme"), "max_in_cpu": 0}
    out = {"rank": dist.get_rank()}
    for home, offload in (("nvme", nvme), ("host", {"device": "cpu"})):
        engine, loader = _built_with_staging(
            lambda offload=offload: build_engine(_config(True, offload), prefix),
            lambda model, pin: PartitionStaging(torch.device("cpu"), pin, force_copy=True))
        swap = _param_state(engine).param_swap
        data, losses, live = iter(loader), [], []
        for _ in range(STEPS):
            losses.append(global_mean(engine.train_batch(data).item(), engine))
            live.append(swap.staging.live)  # copies still held when the step ends
        gathers = swap.staging.copies
        result = {"losses": losses, "params": full_parameters(engine)}
        total = sum(s.shard.numel() for s in swap.shards)
        out[home] = {"equal": _equal(plain, result), "copies": gathers, "live": live,
                     "peak live": swap.staging.peak_live, "files": swap.files is not None,
                     "in host memory": (swap.resident_numel, total), "reads": swap.reads,
                     "disk": swap.disk_bytes()}
        swap.close()
    engine, loader = build_engine(_config(True, {**nvme, "pin_memory": True}), prefix)
    swap = _param_state(engine).param_swap
    engine.train_batch(iter(loader))
    out["identity"] = (swap.staging.identity, swap.staging.copies, swap.staging.pin, swap.pool.pin,
                       any(s.shard.is_pinned() for s in swap.shards))
    swap.close()
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_param_offload_staging_to_the_compute_device(pools, token_dataset_prefix_module, tmp_path, world_size):
    """The GPU path's one device-specific step, forced to copy on the CPU: bit for bit, released."""
    for r in pools(world_size).run(_staged_runs, token_dataset_prefix_module, str(tmp_path)):
        for home in ("nvme", "host"):
            h = r[home]
            assert h["equal"], (home, r)
            assert h["copies"] > 0 and h["live"] == [0] * STEPS and 1 <= h["peak live"] <= 3, (home, h)
        assert r["nvme"]["files"] and r["nvme"]["reads"] > 0 and r["nvme"]["disk"] > 0, r["nvme"]
        resident, total = r["host"]["in host memory"]
        # device cpu: every partition stays in host memory, nothing read or written
        assert not r["host"]["files"] and resident == total > 0 and r["host"]["reads"] == 0 \
            and r["host"]["disk"] == 0, r["host"]
        assert r["identity"] == (True, 0, False, False, False), r["identity"]


def test_param_offload_compute_device_errors():
    """Parameters on a device other than cpu/cuda, or on several, are errors naming them."""
    from megazero.zero.param_offload import compute_staging

    with pytest.raises(ValueError, match="'meta' is not implemented"):
        compute_staging(torch.nn.Linear(2, 2, device="meta"), pin=False)
    two = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="several devices"):
        compute_staging(two, pin=False)
    assert compute_staging(torch.nn.Linear(2, 2), pin=True).identity
