"""ZeRO checkpoints: exact round trips per stage, re-partitioned loads at other DP sizes, zero_to_fp32."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megazero.checkpoint.consolidate import consolidate_fp32_state_dict, save_consolidated
from megazero.zero import GatheredParameters
from megazero.zero.master_partitions import master_partition
from tests.process_pool import ProcessPool
from tests.training_helpers import base_config, build_engine, train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ODD_MODEL = dict(hidden_size=33, num_attention_heads=3, vocab_size=251, make_vocab_size_divisible_by=1)


def _config(stage: int, **extra) -> dict:
    # micro-batches of 2 at every DP size (accumulation makes up the rest): with dropout on, a
    # micro-batch's masks then follow it from one DP size to another, so a re-partitioned load
    # continues exactly
    return base_config(train_micro_batch_size_per_gpu=2, zero_optimization={
        "stage": stage, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 0}, **extra)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_round_trip_is_exact_in_a_new_process_group(pools, token_dataset_prefix_module, tmp_path, stage):
    config = _config(stage, bf16={"enabled": True})
    save_dir = str(tmp_path / "ckpt")
    uninterrupted = pools(2).run(train, config, token_dataset_prefix_module, 6, 0, save_dir, 3)
    assert sorted(os.listdir(os.path.join(save_dir, "global_step3"))) == [
        "manifest.json", "mp_rank_00_model_states.pt", "rng_state_rank0.pt", "rng_state_rank1.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    fresh = ProcessPool(2)
    try:
        resumed = fresh.run(train, config, token_dataset_prefix_module, 6, 0, None, None, save_dir)
    finally:
        fresh.close()
    for full, cont in zip(uninterrupted, resumed):
        assert cont["losses"] == full["losses"][3:]
        for name, p in full["params"].items():
            assert torch.equal(cont["params"][name], p), name


@pytest.fixture(scope="module")
def saved_at(pools, token_dataset_prefix_module, tmp_path_factory):
    """Checkpoints after 4 steps, per (stage, DP size): {(stage, dp): save_dir}."""
    made = {}

    def get(stage: int, dp: int) -> str:
        if (stage, dp) not in made:
            save_dir = str(tmp_path_factory.mktemp(f"zero{stage}_dp{dp}"))
            pools(dp).run(train, _config(stage), token_dataset_prefix_module, 4, 0, save_dir, 4)
            made[(stage, dp)] = save_dir
        return made[(stage, dp)]

    return get


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("source, target", [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_load_at_another_data_parallel_size(pools, saved_at, token_dataset_prefix_module, stage, source, target):
    save_dir = saved_at(stage, source)
    same = pools(source).run(train, _config(stage), token_dataset_prefix_module, 7, 0, None, None, save_dir)[0]
    other = pools(target).run(train, _config(stage), token_dataset_prefix_module, 7, 0, None, None, save_dir)
    for result in other:
        assert len(result["losses"]) == 3
        for a, b in zip(same["losses"], result["losses"]):  # Adam moments re-cut too: later steps agree
            assert abs(a - b) <= 1e-5 * a, (same["losses"], result["losses"])
        for name, p in same["params"].items():
            torch.testing.assert_close(result["params"][name], p, rtol=0, atol=2e-5)


def _live_weights(prefix: str, config: dict, save_dir: str) -> dict:
    engine, loader = build_engine(config, prefix, model_overrides=ODD_MODEL)
    data = iter(loader)
    for _ in range(2):
        engine.train_batch(data)
    engine.save_checkpoint(save_dir)
    padding = sum(part.layout.numel - part.layout.unpadded_numel for part in getattr(engine.dp, "parts", []))
    masters = {}
    names = {id(p): n for n, p in engine.module.named_parameters()}
    if engine.dp.stage > 0:  # the fp32 masters, all-gathered
        for part in engine.dp.parts:
            full = torch.zeros(part.layout.numel)
            mine = master_partition(part)
            pieces = [torch.zeros_like(mine) for _ in range(engine.dp_world_size)]
            torch.distributed.all_gather(pieces, mine, group=engine.dp_group)
            for rank, piece in enumerate(pieces):
                for b in part.layout.buckets:
                    lo, hi = part.layout.rank_range(b, rank)
                    full[lo:hi] = piece[b.partition_offset:b.partition_offset + hi - lo]
            for p in part.layout.params:
                offset, numel = part.layout.offsets[p], part.layout.numels[p]
                masters[names[id(p)]] = full[offset:offset + numel].view(part.layout.shapes[p]).clone()
    else:
        masters = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    with GatheredParameters(list(engine.module.parameters())):
        model = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"masters": masters, "model": model, "padding": padding}


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (1, "bf16"), (2, "fp32"), (3, "fp32"), (3, "bf16")])
def test_zero_to_fp32_equals_the_live_weights(pools, token_dataset_prefix_module, tmp_path, stage, precision):
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    save_dir = str(tmp_path / "ckpt")
    live = pools(4).run(_live_weights, token_dataset_prefix_module, _config(stage, **extra), save_dir)[0]
    if stage > 0:
        assert live["padding"] > 0, "the odd-sized model must exercise the padding"
    state = consolidate_fp32_state_dict(save_dir)
    assert set(state) >= set(live["masters"])
    for name, master in live["masters"].items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], master), name
        assert torch.equal(state[name].to(live["model"][name].dtype), live["model"][name]), name
    for suffix in (".safetensors", ".pt"):
        out = str(tmp_path / f"consolidated{suffix}")
        if suffix == ".pt":  # the command-line script
            subprocess.run([sys.executable, os.path.join(REPO, "scripts", "zero_to_fp32.py"), save_dir, out],
                           check=True, capture_output=True)
        else:
            save_consolidated(state, out)
        if suffix == ".pt":
            back = torch.load(out, weights_only=True)
        else:
            from safetensors.torch import load_file

            back = load_file(out)
        assert all(torch.equal(back[k], v) for k, v in state.items())
