"""Checkpoints move between layouts (TP, PP, DP, ZeRO stage), optimizer state included: after
loading at the new layout, the next steps' losses equal those of the source layout's own run.

Each case trains the source layout 3 steps, saves, and goes on to step 5; the target layout
loads the step-3 checkpoint and trains to step 5. fp32; the layouts differ only in summation
order, so losses agree to ~1e-7 relative (checked at 1e-5).

Dropout is on (0.1) with layout-invariant masks (`dropout_masks.layout_invariant`) in source and
target: every mask is drawn per sample (and global attention head), so the target layout draws the
source's masks from step 4 on. In the default mode it would not where TP or the micro-batch size
change (a TP rank draws its own masks inside the tensor-parallel region; see test_model_parallel).
With the default masks, the data-parallel size and ZeRO stage change exactly
(test_zero_checkpoint), and the same layout resumes bit for bit (test_checkpoint).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from tests.conftest import REPO
from tests.training_helpers import base_config, train

SAVE_AT, STEPS = 3, 5
LOSS_RTOL = 1e-5


def _train_recording_warnings(*args) -> dict:
    """train(*args), with the messages of the warnings it raised on this rank."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(*args)
    return {**result, "warnings": [str(w.message) for w in caught]}


def _run(pools, prefix: str, layout: tuple[int, int, int, int], save_dir=None, load_dir=None,
         model_overrides: dict | None = None) -> dict:
    tp, pp, dp, stage = layout
    zero = {"stage": stage, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 0}
    config = base_config(train_micro_batch_size_per_gpu=2 if pp > 1 else 8 // dp, zero_optimization=zero,
                         dropout_masks={"layout_invariant": True})  # dropout 0.1: the module docstring
    results = pools(tp * pp * dp).run(_train_recording_warnings, config, prefix, STEPS, 0, save_dir,
                                      SAVE_AT if save_dir else None, load_dir,
                                      model_overrides, (tp, pp))
    return results[0]


def _assert_continues(source: dict, target: dict, vocab_size: int | None = None) -> None:
    """The target's losses and final weights are the source's; vocab_size: the word embedding is
    padded differently, so it is compared on its token rows (its padding rows must be zero)."""
    expected = source["losses"][SAVE_AT:]
    assert len(target["losses"]) == len(expected) == STEPS - SAVE_AT
    for a, b in zip(expected, target["losses"]):
        assert abs(a - b) <= LOSS_RTOL * abs(a), (expected, target["losses"])
    assert target["params"].keys() == source["params"].keys()
    for name, value in source["params"].items():
        other = target["params"][name]
        if vocab_size is not None and other.shape != value.shape:
            assert not other[vocab_size:].any() and not value[vocab_size:].any(), f"{name}: padding rows not zero"
            other, value = other[:vocab_size], value[:vocab_size]
        torch.testing.assert_close(other, value, rtol=0, atol=2e-5, msg=name)


CASES = [((2, 1, 2, 1), (1, 2, 2, 2)), ((1, 2, 1, 0), (2, 1, 2, 3)), ((2, 2, 1, 1), (1, 1, 1, 0)),
         ((1, 1, 2, 3), (2, 2, 1, 2))]


@pytest.mark.parametrize("source,target", CASES, ids=["-".join(map(str, s)) + "_to_" + "-".join(map(str, t))
                                                      for s, t in CASES])
def test_load_at_another_layout(pools, token_dataset_prefix_module, tmp_path, source, target):
    before = _run(pools, token_dataset_prefix_module, source, save_dir=str(tmp_path))
    after = _run(pools, token_dataset_prefix_module, target, load_dir=str(tmp_path))
    _assert_continues(before, after)


def test_convert_checkpoint_script(pools, token_dataset_prefix_module, tmp_path):
    source = _run(pools, token_dataset_prefix_module, (2, 2, 1, 1), save_dir=str(tmp_path / "src"))
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "convert_checkpoint.py"), "--load",
                    str(tmp_path / "src"), "--save", str(tmp_path / "dst"), "--target-tensor-parallel-size", "1",
                    "--target-pipeline-parallel-size", "2"], check=True, cwd=REPO)
    files = sorted(os.listdir(tmp_path / "dst" / f"global_step{SAVE_AT}"))
    assert "mp_rank_00_000_model_states.pt" in files and "mp_rank_00_001_optim_states.pt" in files
    assert not any(f.startswith("mp_rank_01") for f in files)
    target = _run(pools, token_dataset_prefix_module, (1, 2, 2, 2), load_dir=str(tmp_path / "dst"))
    _assert_continues(source, target)


def test_zero_to_fp32_joins_shards_and_stages(pools, token_dataset_prefix_module, tmp_path):
    from megazero.checkpoint.consolidate import consolidate_fp32_state_dict

    zero = {"stage": 2, "reduce_bucket_size": 20000}
    config = base_config(train_micro_batch_size_per_gpu=2, zero_optimization=zero)
    result = pools(4).run(train, config, token_dataset_prefix_module, SAVE_AT, 0, str(tmp_path), SAVE_AT, None, None,
                          (2, 2))[0]
    state = consolidate_fp32_state_dict(str(tmp_path))
    assert state.keys() == result["params"].keys()
    for name, value in result["params"].items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


# 300 tokens with make_vocab_size_divisible_by 64: 320 rows at TP=1, 384 at TP=2 (the recipe's
# 8,000 are 8,064 and 8,192): loading at the other TP size adds or drops padding rows.
PADDED = {"vocab_size": 300}
PADDING_CASES = [((2, 1, 1, 0), (1, 2, 1, 2)), ((2, 1, 1, 0), (1, 1, 2, 2)), ((1, 1, 2, 3), (2, 1, 1, 1))]


@pytest.mark.parametrize("source,target", PADDING_CASES, ids=["tp2_to_pp2_zero2", "tp2_to_dp2_zero2",
                                                              "dp2_zero3_to_tp2_zero1"])
def test_load_where_the_vocabulary_pads_differently(pools, token_dataset_prefix_module, tmp_path, source, target):
    """The padding rows take no part in the model, so the continuation is the source's own one
    (before, 64 trained rows were dropped with a warning and the losses changed); no warning
    about rows, since only padding rows are added or dropped."""
    before = _run(pools, token_dataset_prefix_module, source, save_dir=str(tmp_path), model_overrides=PADDED)
    after = _run(pools, token_dataset_prefix_module, target, load_dir=str(tmp_path), model_overrides=PADDED)
    assert {before["params"]["wte.weight"].shape[0], after["params"]["wte.weight"].shape[0]} == {320, 384}
    _assert_continues(before, after, PADDED["vocab_size"])
    assert not [w for w in after["warnings"] if "rows" in w], after["warnings"]


def test_convert_checkpoint_script_where_the_vocabulary_pads_differently(pools, token_dataset_prefix_module,
                                                                         tmp_path):
    """scripts/convert_checkpoint.py from TP=2 (384 rows) to TP=1 x PP=2 (320 rows): the files hold
    the target's own shapes (weights and Adam moments), and training continues as the source's."""
    from megazero.checkpoint.io import load_file

    source = _run(pools, token_dataset_prefix_module, (2, 1, 1, 0), save_dir=str(tmp_path / "src"),
                  model_overrides=PADDED)
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "convert_checkpoint.py"), "--load",
                    str(tmp_path / "src"), "--save", str(tmp_path / "dst"), "--target-tensor-parallel-size", "1",
                    "--target-pipeline-parallel-size", "2"], check=True, cwd=REPO)
    tag = tmp_path / "dst" / f"global_step{SAVE_AT}"
    assert load_file(str(tag / "mp_rank_00_000_model_states.pt"))["module"]["wte.weight"].shape[0] == 320
    optim = load_file(str(tag / "mp_rank_00_001_optim_states.pt"))
    index = optim["param_names"].index("wte.weight")  # the last stage's copy of the tied embedding
    assert optim["master_params"][index].shape[0] == optim["optimizer"]["state"][index]["exp_avg"].shape[0] == 320
    target = _run(pools, token_dataset_prefix_module, (1, 2, 1, 2), load_dir=str(tmp_path / "dst"),
                  model_overrides=PADDED)
    _assert_continues(source, target, PADDED["vocab_size"])
