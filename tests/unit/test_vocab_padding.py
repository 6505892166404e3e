"""Vocabulary padding is invisible: the same model padded two ways (as TP=1 and TP=2 pad 8,000 to
8,064 and 8,192) starts the same, has the same loss and the same gradients on its real rows (to
fp32 summation order), returns logits of the true vocabulary only, and never moves its padding rows; checkpoint
resharding adds or drops padding rows silently but refuses to drop a token; the Hugging Face
export holds the true vocabulary and an import pads it again."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from megazero.checkpoint.io import CheckpointError
from megazero.checkpoint.universal import fit_vocabulary_rows
from megazero.tensor_parallel import vocab_parallel_cross_entropy
from megazero.tensor_parallel.random import get_rng_tracker
from models.bert import Bert, BertConfig
from models.gpt import GPT, GPTConfig

VOCAB = 300
PADDINGS = (64, 192)  # 300 -> 320 rows, 300 -> 384 rows
SMALL = dict(vocab_size=VOCAB, seq_length=16, num_layers=2, hidden_size=32, num_attention_heads=4, dropout=0.1)


def _pair(model_class, config_class, **extra) -> list:
    models = []
    for multiple in PADDINGS:
        torch.manual_seed(0)
        models.append(model_class(config_class(**SMALL, **extra, make_vocab_size_divisible_by=multiple)))
    assert [m.wte.weight.shape[0] for m in models] == [320, 384]
    return models


def _assert_same_on_real_rows(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        rows = min(p.shape[0], q.shape[0])
        torch.testing.assert_close(p[:rows], q[:rows], rtol=0, atol=0, msg=name)
        # gradients to fp32 summation order: the vocabulary GEMMs over 320 and 384 rows block their
        # sums differently on some CPUs (AVX-512: up to 3e-7 of the norm, 16 unit roundoffs allowed)
        error = (p.grad[:rows] - q.grad[:rows]).norm()
        assert error <= 16 * 2.0 ** -24 * q.grad[:rows].norm(), (name, error.item(), q.grad[:rows].norm().item())
        if p.shape != q.shape:  # the vocabulary's rows (the word embedding, BERT's MLM bias)
            for x in (p, q):
                assert not x[VOCAB:].any() and not x.grad[VOCAB:].any(), f"{name}: padding rows not zero"


def test_gpt_function_does_not_depend_on_padding():
    models = _pair(GPT, GPTConfig)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in models:
        get_rng_tracker().reset()  # attention dropout from the default generator, not a stale tracker state
        torch.manual_seed(5)  # the same dropout masks
        loss = model(ids, labels=ids.roll(-1, dims=1))
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=0)
    _assert_same_on_real_rows(*models)
    with torch.no_grad():
        logits = [m.eval()(ids) for m in models]
    assert logits[0].shape == logits[1].shape == (2, 16, VOCAB)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-6, atol=1e-6)


def test_bert_masked_lm_does_not_depend_on_padding():
    models = _pair(Bert, BertConfig)
    generator = torch.Generator().manual_seed(2)
    batch = {"input_ids": torch.randint(0, VOCAB, (2, 16), generator=generator),
             "token_type_ids": torch.zeros(2, 16, dtype=torch.long),
             "padding_mask": torch.ones(2, 16, dtype=torch.bool),
             "labels": torch.randint(0, VOCAB, (2, 16), generator=generator),
             "loss_mask": (torch.rand(2, 16, generator=generator) < 0.3).float(),
             "sentence_order": torch.tensor([0, 1])}
    losses = []
    for model in models:
        get_rng_tracker().reset()
        torch.manual_seed(5)
        loss = model(**batch)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=0)
    _assert_same_on_real_rows(*models)


def test_cross_entropy_leaves_padding_columns_out():
    logits = torch.randn(5, 12, requires_grad=True)
    target = torch.tensor([0, 3, 9, 2, 8])
    loss = vocab_parallel_cross_entropy(logits, target, vocab_size=10)
    loss.sum().backward()
    expected = F.cross_entropy(logits.detach()[:, :10], target, reduction="none")
    torch.testing.assert_close(loss, expected)
    assert not logits.grad[:, 10:].any()
    with pytest.raises(ValueError, match="vocab_size 13 must be in 1..12"):
        vocab_parallel_cross_entropy(logits, target, vocab_size=13)


def test_resharding_adds_and_drops_padding_rows_only():
    saved = torch.cat([torch.randn(VOCAB, 4), torch.zeros(84, 4)])  # 384 rows: TP=2's padding
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # padding only: no warning
        assert torch.equal(fit_vocabulary_rows(saved, 320, "wte.weight", VOCAB), saved[:320])
        assert torch.equal(fit_vocabulary_rows(saved[:320], 384, "wte.weight", VOCAB), saved)
    with pytest.raises(CheckpointError, match=r"wte.weight: 384 rows saved, 256 expected, but the vocabulary has 300"):
        fit_vocabulary_rows(saved, 256, "wte.weight", VOCAB)
    # a tensor below the vocabulary on both sides is not a vocabulary tensor: another model shape
    with pytest.raises(CheckpointError, match=r"blocks.0.attn.kv.weight: shape \(256, 4\) saved, this model's has "
                                              r"128 rows: the model configs differ .*--num-query-groups"):
        fit_vocabulary_rows(torch.zeros(256, 4), 128, "blocks.0.attn.kv.weight", VOCAB)
    with pytest.warns(UserWarning, match="no model_config.vocab_size"):
        fit_vocabulary_rows(saved, 320, "wte.weight", None)


def test_hf_gpt2_export_holds_the_true_vocabulary():
    from models.hf_gpt2 import from_hf, hf_config_dict, to_hf_state_dict

    model = _pair(GPT, GPTConfig)[1]
    config = model.config
    hf_config = hf_config_dict(config, 0, 0)
    exported = to_hf_state_dict({n: p.detach() for n, p in model.named_parameters()}, config)
    assert hf_config["vocab_size"] == VOCAB and exported["transformer.wte.weight"].shape == (VOCAB, 32)
    back_config, back = from_hf(hf_config, exported)
    assert back_config.padded_vocab_size == 384
    torch.testing.assert_close(back["wte.weight"], model.wte.weight.detach(), rtol=0, atol=0)
    foreign = {k: v for k, v in hf_config.items() if k != "megazero_config"}  # any GPT-2: padded as megazero pads
    foreign_config, foreign_state = from_hf(foreign, exported)
    assert foreign_config.padded_vocab_size == 384 and foreign_state["wte.weight"].shape == (384, 32)


def test_hf_bert_export_holds_the_true_vocabulary():
    from models.hf_bert import hf_config_dict, to_hf_state_dict

    model = _pair(Bert, BertConfig)[1]
    exported = to_hf_state_dict({n: p.detach() for n, p in model.named_parameters()}, model.config)
    assert hf_config_dict(model.config, 0)["vocab_size"] == VOCAB
    assert exported["bert.embeddings.word_embeddings.weight"].shape == (VOCAB, 32)
    assert exported["cls.predictions.bias"].shape == (VOCAB,)


def test_generate_refuses_a_tokenizer_of_another_vocabulary(corpus_prefix, tmp_path):
    """The logits cover the model's vocab_size tokens only; a tokenizer of another size (here the
    corpus's 8,000 pieces against a 300-token model) is an error, not out-of-range ids."""
    from megazero.checkpoint.model_files import write_weights_checkpoint
    from scripts.generate import main as generate

    model = _pair(GPT, GPTConfig)[0]
    write_weights_checkpoint(model.config, {n: p.detach() for n, p in model.named_parameters()}, str(tmp_path),
                             model_class=GPT)
    with pytest.raises(ValueError, match="has 8000 tokens but the model .* was trained with vocab_size 300"):
        generate(["--load", str(tmp_path), "--tokenizer-model", corpus_prefix + "_tokenizer.model"])
