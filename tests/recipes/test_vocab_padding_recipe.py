"""The GPT recipe continues a checkpoint at another layout with the losses the source layout would
have produced, although the layouts pad the vocabulary differently: the corpus tokenizer's 8,000
pieces are 8,192 rows at TP=2 and 8,064 at TP=1 (make_vocab_size_divisible_by 128 x TP).

torchrun on 2 gloo ranks, the real corpus: 4 iterations at TP=2 and a checkpoint, then iterations
5-8 continued from it at TP=2, at PP=2 and at DP=2 with ZeRO-3. Before padding was left out of the
model, PP=2 and DP=2 dropped 128 trained rows and their losses differed from TP=2's by ~1e-2. The
same runs check what a user sees of the layouts: the banner, the TP=2 sample (TP peers generate
together), the resume line, the final validation of the pipelined run, and the sample at ZeRO-3
(every DP rank generates: each forward gathers its parameters over them).

Dropout stays at the recipe's default, 0: each continuation here changes TP, and attention
dropout masks are drawn per TP rank inside the tensor-parallel region (Megatron's design), so with
dropout on the target layout would draw its own masks from iteration 5 on. That padding leaves the
model unchanged with dropout on is tests/distributed/test_model_parallel.py's
test_padding_does_not_change_the_model_with_dropout (TP=2 padded to 384 and to 320 rows).
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.launch_helpers import finish, start, torchrun

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOSS_RTOL = 1e-5  # fp32; the layouts differ only in the order of sums

pytestmark = pytest.mark.slow


def _start(corpus_prefix: str, tmp_path, name: str, iters: int, extra: tuple[str, ...]) -> subprocess.Popen:
    """The recipe under torchrun on 2 ranks, started (TensorBoard events in tmp_path/name/tb)."""
    return start(torchrun("pretrain_gpt.py", "--data-path", corpus_prefix, "--num-layers", "2", "--hidden-size", "64",
                          "--num-attention-heads", "4", "--seq-length", "64", "--global-batch-size", "16",
                          "--micro-batch-size", "4", "--lr", "0.005", "--train-iters", str(iters), "--log-interval",
                          "1", "--eval-interval", "1000", "--eval-iters", "1", "--save-interval", "4",
                          "--tensorboard-dir", str(tmp_path / name / "tb"), "--peak-flops", "1e11", "--sample-tokens",
                          "4", *extra), tmp_path)


def _recipe(corpus_prefix: str, tmp_path, name: str, iters: int, extra: tuple[str, ...]) -> str:
    return finish(_start(corpus_prefix, tmp_path, name, iters, extra))[0]


def _losses(tmp_path, name: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / name / "tb"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("lm loss")}


def _zero_config(tmp_path, stage: int) -> str:
    with open(os.path.join(REPO, "configs", "ds_gpt2_cpu.json")) as f:
        config = json.load(f)
    config["zero_optimization"]["stage"] = stage
    path = tmp_path / f"ds_zero{stage}.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_recipe_continues_at_other_layouts_where_the_vocabulary_pads_differently(corpus_prefix, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    source = _recipe(corpus_prefix, tmp_path, "source", 4, ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                            "--save", ckpt))
    # the sample at the end of a TP=2 + SP run: the TP peers generate together
    assert "TP 2 x PP 1 x DP 1" in source and "----- sample -----" in source, source[-3000:]
    continued = {}
    layouts = [("tp2", ("--tensor-model-parallel-size", "2")), ("pp2", ("--pipeline-model-parallel-size", "2")),
               ("dp2_zero3", ("--deepspeed_config", _zero_config(tmp_path, 3)))]
    banners = {"tp2": "TP 2 x PP 1 x DP 1", "pp2": "TP 1 x PP 2 x DP 1", "dp2_zero3": "TP 1 x PP 1 x DP 2"}
    # the continuations only read the checkpoint: they run at once (one launch leaves the 2 cores
    # idle part of the time: start-up of torchrun's agent, rendezvous, collectives)
    runs = {name: _start(corpus_prefix, tmp_path, name, 8, ("--load", ckpt, *flags)) for name, flags in layouts}
    outputs = dict(zip(runs, finish(*runs.values())))
    for name, out in outputs.items():
        assert banners[name] in out and "resumed from" in out and "at iteration 4" in out, out[-3000:]
        # the run ends validated, also pipelined (the last stage computes the loss)
        assert re.search(r"validation at iteration 8 \| lm loss: [0-9.]+", out), out[-3000:]
        assert "----- sample -----" in out, out[-3000:]  # also pipelined: the stages generate together
        if name.startswith("dp2"):  # the header line names the ZeRO stage
            assert f", ZeRO-{name[-1]}" in out, out[-3000:]
        assert "rows saved" not in out, out[-3000:]  # only padding rows were added or dropped: no warning
        if name == "pp2":  # the banner says how the layers were split
            # (inclusive ranges: 2 layers, one per stage), and how the stages' messages travel
            assert "pipeline: 2 stages, split parameters: layers [0 | 1], p2p through shared memory" in out, out[-3000:]
        losses = _losses(tmp_path, name)
        assert sorted(losses) == [5, 6, 7, 8], losses
        continued[name] = [losses[i] for i in range(5, 9)]
    for name in ("pp2", "dp2_zero3"):
        for step, (a, b) in enumerate(zip(continued["tp2"], continued[name]), start=5):
            assert abs(a - b) <= LOSS_RTOL * abs(a), f"iteration {step}: TP=2 {a} vs {name} {b}: {continued}"
