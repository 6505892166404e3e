"""The one-process GPT tools on a checkpoint trained at TP=2 x PP=2 with ZeRO-1: loading it whole,
evaluate.py, generate.py, export to Hugging Face transformers (same logits) and import back (the
round trip is exact, and an engine at another layout continues training from the import)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from megazero.checkpoint.model_files import load_model
from models.gpt import GPT, GPTConfig
from tests.conftest import CORPUS_PREFIX
from tests.hf_helpers import require_transformers
from tests.training_helpers import base_config, build_engine, global_mean, train

TOKENIZER = CORPUS_PREFIX + "_tokenizer.model"
VOCAB = {"vocab_size": 8000}  # the corpus tokenizer's, so its ids fit the model


@pytest.fixture(scope="module")
def trained(pools, token_dataset_prefix_module, tmp_path_factory):
    save = str(tmp_path_factory.mktemp("ckpt"))
    config = base_config(train_micro_batch_size_per_gpu=2, zero_optimization={"stage": 1})
    result = pools(4).run(train, config, token_dataset_prefix_module, 4, 0, save, 4, None, VOCAB, (2, 2))[0]
    return save, result


def test_load_model_joins_the_layout(trained):
    save, result = trained
    model = load_model(save, model_class=GPT, config_class=GPTConfig)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), result["params"][name], rtol=0, atol=0, msg=name)


def test_evaluate(trained, token_dataset_prefix_module):
    from megazero.data import IndexedDataset
    from scripts.evaluate import main as evaluate

    save, _ = trained
    result = evaluate(["--load", save, "--data-path", token_dataset_prefix_module, "--max-tokens", "200"])
    model = load_model(save, model_class=GPT, config_class=GPTConfig)
    tokens = torch.from_numpy(IndexedDataset(token_dataset_prefix_module).tokens[:200].astype("int64"))
    window = model.config.seq_length
    total, count = 0.0, 0
    with torch.no_grad():  # non-overlapping windows, every target once
        for start in range(0, 199, window):
            end = min(start + window, 199)
            logits = model(tokens[start:end].unsqueeze(0))[0]
            total += float(torch.nn.functional.cross_entropy(logits, tokens[start + 1:end + 1], reduction="sum"))
            count += end - start
    assert result["tokens"] == count == 199
    assert result["loss"] == pytest.approx(total / count, rel=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-6)
    overlapped = evaluate(["--load", save, "--data-path", token_dataset_prefix_module, "--max-tokens", "200",
                           "--stride", "8"])
    assert overlapped["tokens"] == 199 and overlapped["loss"] < result["loss"] * 1.05  # more context per token


def test_generate_with_and_without_cache(trained, corpus_prefix):
    from scripts.generate import main as generate

    save, _ = trained
    common = ["--load", save, "--tokenizer-model", TOKENIZER, "--prompt", "ab", "--max-new-tokens", "40",
              "--temperature", "0"]
    assert generate(common) == generate(common + ["--no-kv-cache"])


def test_export_to_transformers_and_back(trained, corpus_prefix, tmp_path):
    require_transformers()
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import GPT2LMHeadModel

    from scripts.export_hf import main as export
    from scripts.import_hf import main as import_hf

    save, _ = trained
    export(["--load", save, "--out", str(tmp_path / "hf"), "--tokenizer-model", TOKENIZER])
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    ours = load_model(save, model_class=GPT, config_class=GPTConfig)
    ids = torch.randint(0, ours.config.vocab_size, (2, ours.config.seq_length),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(ids)
        actual = hf(ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)

    import_hf(["--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "imported")])
    export(["--load", str(tmp_path / "imported"), "--out", str(tmp_path / "hf2"), "--tokenizer-model", TOKENIZER])
    from safetensors.torch import load_file

    first, second = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "hf2" /
                                                                                       "model.safetensors"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def _continue_from_import(prefix: str, load_dir: str) -> list[float]:
    config = base_config(train_micro_batch_size_per_gpu=4, zero_optimization={"stage": 2})
    engine, loader = build_engine(config, prefix, 0, VOCAB, (2, 1))
    path, _ = engine.load_checkpoint(load_dir)
    assert path is not None and engine.global_steps == 0
    data = iter(loader)
    return [global_mean(engine.train_batch(data).item(), engine) for _ in range(2)]


def test_engine_continues_from_an_import(pools, trained, token_dataset_prefix_module, tmp_path):
    from scripts.export_hf import main as export
    from scripts.import_hf import main as import_hf

    save, result = trained
    export(["--load", save, "--out", str(tmp_path / "hf"), "--tokenizer-model", TOKENIZER])
    import_hf(["--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "imported")])
    losses = pools(4).run(_continue_from_import, token_dataset_prefix_module, str(tmp_path / "imported"))[0]
    assert len(losses) == 2
    assert losses[0] < result["losses"][0] - 0.1  # it starts from the trained weights, not from scratch
