"""The Llama recipe with --context-parallel-size 2 (ring and all-to-all) on 2 gloo ranks logs the
losses of --context-parallel-size 1 (the same global batch: DP 2 there, CP 2 here), with dropout
0.1 on layout-invariant masks (an engine JSON with dropout_masks.layout_invariant), names CP in
its header, and its checkpoint continues at CP 1 exactly as the CP 1 checkpoint does (and generates
text in one process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.launch_helpers import finish, start, torchrun
from tests.recipes.test_pretrain_gpt import _scalars

pytestmark = pytest.mark.slow

SHAPE = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--seq-length", "64", "--global-batch-size", "8", "--micro-batch-size", "4", "--lr", "0.005",
         "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", "--peak-flops", "1e11",
         "--sample-tokens", "0", "--dropout", "0.1")


def _llama(tmp_path, name: str, *flags: str) -> subprocess.Popen:
    """The Llama recipe on 2 ranks, started (TensorBoard events in tmp_path/tb_<name>)."""
    engine = tmp_path / "engine.json"
    if not engine.exists():  # the recipe's engine JSON, with every layout drawing the same dropout masks
        with open(os.path.join(REPO, "configs", "ds_gpt2_cpu.json")) as f:
            config = json.load(f)
        engine.write_text(json.dumps({**config, "dropout_masks": {"layout_invariant": True}}))
    return start(torchrun("pretrain_llama.py", "--data-path", os.path.join(REPO, "data", "gpt2", "shakespeare"),
                          *SHAPE, "--tensorboard-dir", str(tmp_path / f"tb_{name}"), "--deepspeed_config", str(engine),
                          *flags), tmp_path)


def _losses(tmp_path, name: str) -> list[float]:
    return [value for _, value in _scalars(str(tmp_path / f"tb_{name}"))["lm loss"]]


def test_context_parallel_recipe_logs_the_cp1_losses_and_its_checkpoint_continues_at_cp1(corpus_prefix, tmp_path):
    runs = {"cp1": ("--context-parallel-size", "1"), "p2p": ("--context-parallel-size", "2"),
            "a2a": ("--context-parallel-size", "2", "--cp-comm-type", "a2a")}
    # side by side: the launches' start-up leaves the cores idle part of the time
    outputs = dict(zip(runs, finish(*(_llama(tmp_path, name, *flags, "--train-iters", "4", "--save",
                                             str(tmp_path / name), "--save-interval", "4")
                                      for name, flags in runs.items()))))
    for name in ("p2p", "a2a"):
        assert f"CP 2 ({name}) x DP 1" in outputs[name], outputs[name]
    reference = _losses(tmp_path, "cp1")
    assert len(reference) == 4
    for name in ("p2p", "a2a"):
        assert _losses(tmp_path, name) == pytest.approx(reference, rel=1e-5)
    # both checkpoints continue at CP 1: the same next losses; the CP 2 one generates in one process
    generate = start([sys.executable, os.path.join(REPO, "scripts", "generate.py"), "--load", str(tmp_path / "p2p"),
                      "--prompt", "ROMEO:", "--max-new-tokens", "4"], tmp_path)
    *resumed, generated = finish(*(_llama(tmp_path, f"resume_{name}", "--train-iters", "6", "--load",
                                          str(tmp_path / name)) for name in ("cp1", "p2p")), generate)
    for out in resumed:
        assert "resumed from" in out, out
    assert "ROMEO:" in generated, generated[-2000:]
    assert _losses(tmp_path, "resume_p2p") == pytest.approx(_losses(tmp_path, "resume_cp1"), rel=1e-5)
