"""Checkpoints: exact resume in a new process group, atomic saves, pickle-free files, clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megazero.checkpoint import CheckpointError
from tests.process_pool import ProcessPool
from tests.training_helpers import base_config, build_engine, train


@pytest.fixture(scope="module")
def fresh_pool():
    """2 gloo ranks that are not the session's pools(2): the resumes run in processes, and a process
    group, that never saw the saving run (one pool for the module: a start costs seconds)."""
    pool = ProcessPool(2)
    yield pool
    pool.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_resume_is_bit_exact_in_a_new_process_group(pools, fresh_pool, token_dataset_prefix_module, tmp_path,
                                                    precision):
    extra = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
             "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}}}[precision]
    config = base_config(train_micro_batch_size_per_gpu=2, **extra)  # DP=2 x accumulation 2
    save_dir = str(tmp_path / "ckpt")
    uninterrupted = pools(2).run(train, config, token_dataset_prefix_module, 8, 0, save_dir, 4)
    assert sorted(os.listdir(save_dir)) == ["global_step4", "latest"]
    resumed = fresh_pool.run(train, config, token_dataset_prefix_module, 8, 0, None, None, save_dir)
    for full, cont in zip(uninterrupted, resumed):
        assert cont["losses"] == full["losses"][4:], "losses after resume differ from the uninterrupted run"
        for name, p in full["params"].items():
            assert torch.equal(cont["params"][name], p), name
        assert cont["lr"] == full["lr"] and cont["scale"] == full["scale"]


@pytest.mark.parametrize("layout,overrides,stage", [((2, 1), {"sequence_parallel": True}, 1), ((1, 2), {}, 2)],
                         ids=["tp2_sp_zero1", "pp2_zero2"])
def test_model_parallel_resume_with_dropout_is_bit_exact(pools, fresh_pool, token_dataset_prefix_module, tmp_path,
                                                         layout, overrides, stage):
    """Dropout 0.1 (TINY): the tracker's per-TP-rank masks and each stage's masks continue too."""
    config = base_config(train_micro_batch_size_per_gpu=2, zero_optimization={"stage": stage})
    save_dir = str(tmp_path / "ckpt")
    uninterrupted = pools(2).run(train, config, token_dataset_prefix_module, 6, 0, save_dir, 3, None, overrides,
                                 layout)
    resumed = fresh_pool.run(train, config, token_dataset_prefix_module, 6, 0, None, None, save_dir, overrides,
                             layout)
    for full, cont in zip(uninterrupted, resumed):
        assert cont["losses"] == full["losses"][3:]
        assert all(torch.equal(cont["params"][name], p) for name, p in full["params"].items())


def _load_every_file_weights_only(save_dir: str) -> list[str]:
    tag = open(os.path.join(save_dir, "latest")).read().strip()
    names = sorted(os.listdir(os.path.join(save_dir, tag)))
    with open(os.path.join(save_dir, tag, "manifest.json")) as f:  # the one JSON file: sizes and checksums
        json.load(f)
    names.remove("manifest.json")
    for name in names:
        torch.load(os.path.join(save_dir, tag, name), weights_only=True)
    return names


def test_files_load_with_weights_only(pools, token_dataset_prefix_module, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    pools(2).run(train, base_config(bf16={"enabled": True}), token_dataset_prefix_module, 2, 0, save_dir, 2)
    assert _load_every_file_weights_only(save_dir) == [
        "mp_rank_00_model_states.pt", "mp_rank_00_optim_states.pt", "rng_state_rank0.pt", "rng_state_rank1.pt"]


def _save_unpicklable_client_state(prefix: str, save_dir: str) -> str:
    engine, _ = build_engine(base_config(), prefix)
    try:
        engine.save_checkpoint(save_dir, client_state={"args": object()})
    except CheckpointError as e:
        return str(e)
    return "no error"


def test_client_state_must_be_plain(pools, token_dataset_prefix_module, tmp_path):
    message = pools(1).run(_save_unpicklable_client_state, token_dataset_prefix_module, str(tmp_path))[0]
    assert "client_state['args'] holds a object" in message


def _load_missing(prefix: str, load_dir: str) -> list:
    engine, _ = build_engine(base_config(), prefix)
    out = [engine.load_checkpoint(load_dir)]  # no latest: (None, None)
    try:
        engine.load_checkpoint(load_dir, tag="global_step7")
    except CheckpointError as e:
        out.append(str(e))
    return out


def test_missing_checkpoints(pools, token_dataset_prefix_module, tmp_path):
    none, message = pools(1).run(_load_missing, token_dataset_prefix_module, str(tmp_path))[0]
    assert none == (None, None)
    assert "global_step7" in message and "not found" in message


KILLED_SAVER = r"""
import torch, megazero
from models.gpt import GPT, GPTConfig
megazero.init_distributed()
model = GPT(GPTConfig(vocab_size=8000, num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=64))
engine, *_ = megazero.initialize(model=model, config={{"train_batch_size": 1,
    "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}}})
step = 0
while True:
    step += 1
    engine.global_steps = step
    engine.save_checkpoint({save_dir!r}, client_state={{"step": step}})
    print(step, flush=True)
"""


def _load_latest(prefix: str, save_dir: str):
    from megazero.checkpoint.engine_state import MODEL_FILE, resolve_tag

    tag = resolve_tag(save_dir, None)
    state = torch.load(os.path.join(save_dir, tag, MODEL_FILE), weights_only=True)
    return tag, state["client_state"]["step"]


def test_killed_save_leaves_previous_checkpoint_loadable(pools, token_dataset_prefix_module, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    script = KILLED_SAVER.format(save_dir=save_dir)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "1"  # one complete checkpoint
        deadline = time.time() + 60
        while not any(name.endswith(".tmp") for name in os.listdir(save_dir)):  # a save is in progress
            assert time.time() < deadline, "no save in progress was seen"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    assert any(name.endswith(".tmp") for name in os.listdir(save_dir)), "the kill landed inside a save"
    tag, step = pools(1).run(_load_latest, token_dataset_prefix_module, save_dir)[0]
    assert tag == f"global_step{step}"
    assert _load_every_file_weights_only(save_dir)
