"""The GPT recipe end to end: torchrun on 2 gloo ranks, real corpus, TensorBoard, checkpoints, resume."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow


def _run_recipe(corpus_prefix: str, tmp_path, iters: int, extra: tuple[str, ...] = ()) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "scripts", "pretrain_gpt.py"), "--data-path", corpus_prefix,
           "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
           "--global-batch-size", "16", "--micro-batch-size", "4", "--lr", "0.005",
           "--train-iters", str(iters), "--log-interval", "10", "--eval-interval", "40", "--eval-iters", "8",
           "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--save-interval", "40",
           "--tensorboard-dir", str(tmp_path / "tb"), "--peak-flops", "1e11", "--sample-tokens", "30", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def _scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_pretrain_gpt_trains_logs_saves_and_resumes(corpus_prefix, tmp_path):
    import json

    out = _run_recipe(corpus_prefix, tmp_path, 200)
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.]+) \| learning rate", out)]
    assert len(losses) == 20 and losses[-1] < losses[0] - 1.0, out
    val = [float(x) for x in re.findall(r"validation at iteration \d+ \| lm loss: ([0-9.]+)", out)]
    unigram = json.load(open(corpus_prefix + "_stats.json"))["unigram_entropy_nats"]
    assert val[-1] < unigram, f"validation loss {val[-1]} is not below the unigram entropy {unigram}"
    assert "tokens/s:" in out and "MFU:" in out and "----- sample -----" in out
    assert sorted(os.listdir(tmp_path / "ckpt")) == sorted([f"global_step{i}" for i in range(40, 201, 40)] + ["latest"])

    scalars = _scalars(str(tmp_path / "tb"))
    for tag in ("lm loss", "learning-rate", "loss-scale", "grad-norm", "iteration-time",
                "throughput/tokens-per-sec", "lm loss validation", "lm loss validation ppl"):
        assert tag in scalars, f"missing TensorBoard scalar {tag!r}; have {sorted(scalars)}"
    assert [step for step, _ in scalars["lm loss"]] == list(range(10, 201, 10))
    assert scalars["lm loss"][-1][1] == pytest.approx(losses[-1], abs=1e-4)

    assert "TFLOP/s per rank:" in out and "throughput/tflops-per-rank" in scalars

    plot = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "plot_logs.py"), str(tmp_path / "tb"),
                           "--out", str(tmp_path / "curves.png")], capture_output=True, text=True)
    assert plot.returncode == 0, plot.stderr
    assert "lm loss validation" in plot.stdout and "learning-rate" in plot.stdout
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"

    resumed = _run_recipe(corpus_prefix, tmp_path, 220)
    assert "at iteration 200" in resumed and "iteration    220/220" in resumed
    assert "global_step220" in os.listdir(tmp_path / "ckpt")


def test_recipe_moe_expert_parallel(corpus_prefix, tmp_path):
    """The MoE GPT config (4 experts, top-2) at EP=2 on 2 ranks with Megatron's flags, dropout on, in
    capacity mode: the console and TensorBoard show the MoE scalars; a checkpoint is written."""
    out = _run_recipe(corpus_prefix, tmp_path, 6, (
        "--model-config", os.path.join(REPO, "configs", "gpt2_moe_cpu.json"), "--num-experts", "4",
        "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--moe-capacity-factor", "1.0",
        "--moe-z-loss-coeff", "0.001", "--dropout", "0.1", "--log-interval", "3", "--eval-interval", "6",
        "--eval-iters", "2", "--save-interval", "6", "--sample-tokens", "8"))
    assert "TP 1 x PP 1 x DP 2 (EP 2)" in out and "----- sample -----" in out, out
    lines = re.findall(r"iteration +\d+/6 .*", out)
    assert len(lines) == 2, out
    for line in lines:
        for name in ("moe aux loss", "moe z loss", "moe dropped fraction", "moe tokens per expert min",
                     "moe tokens per expert max"):
            assert f"| {name}: " in line, line
    scalars = _scalars(str(tmp_path / "tb"))
    for tag in ("moe aux loss", "moe z loss", "moe dropped fraction", "moe tokens per expert min",
                "moe tokens per expert max"):
        assert [step for step, _ in scalars.get(tag, [])] == [3, 6], f"{tag}: {sorted(scalars)}"
    aux = [v for _, v in scalars["moe aux loss"]]
    assert all(0.005 < v < 0.1 for v in aux), aux  # 2 layers x 0.01 x a Switch loss near 1
    assert all(0 < v < 1 for _, v in scalars["moe dropped fraction"])  # capacity factor 1.0 drops some
    lo, hi = scalars["moe tokens per expert min"][-1][1], scalars["moe tokens per expert max"][-1][1]
    assert 0 <= lo <= hi
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["global_step6", "latest"]
