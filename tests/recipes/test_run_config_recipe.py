"""A run is reproduced from its saved run config alone: the GPT recipe (dropout on) writes
run_config.json beside its TensorBoard events and in every checkpoint; `--config` that file, run
to iteration 3 and then resumed to 6, logs the original run's losses exactly. And Megatron-LM's own
GPT example (examples/gpt3/train_gpt3_175b_distributed.sh), its flags as written (GPT-2 BPE files
included), sizes scaled to CPU, trains the recipe at TP=2: the batch ramps up as --rampup-batch-size says and the cosine
schedule ends at --min-lr."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from megazero.checkpoint.model_files import saved_model_config_dict, saved_tokenizer_spec
from megazero.config.run import BatchRampup
from megazero.data import TokenizerSpec
from tests.conftest import REPO
from tests.recipes.test_pretrain_gpt import _scalars

pytestmark = pytest.mark.slow

SHAPE = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--dropout", "0.1", "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "0.003",
         "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", "--save-interval", "3",
         "--peak-flops", "1e11", "--sample-tokens", "0")


def _recipe(tmp_path, *flags: str, nproc: int = 1) -> str:
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc_per_node={nproc}"]
    proc = subprocess.run([*launcher, os.path.join(REPO, "scripts", "pretrain_gpt.py"), *flags],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def test_saved_run_config_reruns_and_resumes_the_run(corpus_prefix, tmp_path):
    _recipe(tmp_path, "--data-path", corpus_prefix, *SHAPE, "--train-iters", "6", "--save", str(tmp_path / "a"),
            "--tensorboard-dir", str(tmp_path / "tb_a"))
    saved = tmp_path / "tb_a" / "run_config.json"
    tree = json.loads(saved.read_text())
    assert tree["model"]["dropout"] == 0.1 and tree["schedule"]["train_iters"] == 6
    checkpoint = torch.load(tmp_path / "a" / "global_step6" / "mp_rank_00_model_states.pt", weights_only=True)
    assert checkpoint["client_state"]["run_config"] == tree
    # the file alone (no data, model or engine flags), stopped at 3 and resumed
    again = ("--config", str(saved), "--save", str(tmp_path / "b"), "--tensorboard-dir", str(tmp_path / "tb_b"))
    _recipe(tmp_path, *again, "--train-iters", "3")
    out = _recipe(tmp_path, *again, "--load", str(tmp_path / "b"))
    assert "resumed from" in out and "at iteration 3" in out, out
    original, rerun = _scalars(str(tmp_path / "tb_a"))["lm loss"], _scalars(str(tmp_path / "tb_b"))["lm loss"]
    assert [step for step, _ in rerun] == [1, 2, 3, 4, 5, 6]
    assert rerun == original


# examples/gpt3/train_gpt3_175b_distributed.sh, array by array, sizes scaled to CPU; its DATA_ARGS'
# GPT-2 BPE files are a byte-level BPE the tests train on the corpus (tests/tokenizer_helpers.py)
GPT_MODEL_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                  "--max-position-embeddings", "32", "--attention-backend", "auto"]
TRAINING_ARGS = ["--micro-batch-size", "1", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "24",
                 "--train-iters", "14", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                 "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
                 "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
                 "--lr-decay-iters", "8"]
MODEL_PARALLEL_ARGS = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1"]


def test_megatrons_gpt3_example_flags_train_the_recipe_at_tp2(bpe_corpus_prefix, byte_level_bpe, tmp_path):
    data_args = ["--data-path", bpe_corpus_prefix + "_train_text_document", "--vocab-file",
                 byte_level_bpe["vocab_file"], "--merge-file", byte_level_bpe["merge_file"], "--split", "949,50,1"]
    logging_args = ["--log-interval", "1", "--save-interval", "7", "--eval-interval", "7", "--save",
                    str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--eval-iters", "1",
                    "--tensorboard-dir", str(tmp_path / "tb")]
    out = _recipe(tmp_path, *GPT_MODEL_ARGS, *TRAINING_ARGS, *MODEL_PARALLEL_ARGS, *data_args, *logging_args,
                  "--peak-flops", "1e11", "--sample-tokens", "0", nproc=2)
    assert "2 ranks = TP 2 x PP 1 x DP 1" in out and "torch.float16" in out, out
    ckpt = str(tmp_path / "ckpt")  # GPT-2's BPE, as Megatron reads those flags: its 1,000 tokens
    assert saved_model_config_dict(ckpt)["vocab_size"] == 1000
    assert saved_tokenizer_spec(ckpt) == TokenizerSpec("gpt2bpe", None, byte_level_bpe["vocab_file"],
                                                      byte_level_bpe["merge_file"])
    lines = [line for line in out.splitlines() if line.startswith(" iteration")]
    batches = [int(re.search(r"global batch size: +(\d+)", line).group(1)) for line in lines]
    lrs = [float(re.search(r"learning rate: ([0-9.e+-]+)", line).group(1)) for line in lines]
    # Megatron's ramp by hand: 2 -> 8 in steps of 2, one step per 24 / 3 = 8 consumed samples
    assert batches == [2, 2, 2, 2, 4, 4, 6, 6, 8, 8, 8, 8, 8, 8], out
    ramp = BatchRampup(2, 2, 24, 8, 1)
    consumed = [0]
    for size in batches:
        assert ramp.batch_size(consumed[-1]) == size
        consumed.append(consumed[-1] + size)
    # the cosine decays over 8 x 8 = 64 samples after a warm-up of int(0.001 x 64) = 0: min-lr past them
    decayed = [6e-6 + 0.5 * (1 + math.cos(math.pi * min(1.0, c / 64))) * (6e-5 - 6e-6) if c <= 64 else 6e-6
               for c in consumed[1:]]
    assert lrs == pytest.approx(decayed, rel=1e-3), (lrs, decayed)
    assert lrs[-1] == pytest.approx(6e-6) and consumed[-1] > 64
