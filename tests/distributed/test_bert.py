"""BERT: the samples (structure, masking rates, sentence-order labels, determinism) and every
parallel layout against the single-process model (fp32, same seed and data, dropout 0.1, 6 steps:
losses within 1e-5 relative, weights within 2e-5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.bert_helpers import SPECIAL, bert_dataset, train_bert, write_sentence_dataset
from tests.hf_helpers import require_transformers
from tests.training_helpers import base_config

STEPS = 6


@pytest.fixture(scope="module")
def sentence_prefix(tmp_path_factory) -> str:
    return write_sentence_dataset(str(tmp_path_factory.mktemp("bert") / "sentences"))


def test_sample_structure_and_masking(sentence_prefix):
    dataset = bert_dataset(sentence_prefix)
    masked = replaced_by_mask = kept = candidates = swapped = 0
    for i in range(len(dataset)):
        item = dataset[i]
        ids, types, pad = item["input_ids"], item["token_type_ids"], item["padding_mask"]
        length = int(pad.sum())
        original = torch.where(item["loss_mask"] > 0, item["labels"], ids)
        assert original[0] == SPECIAL["[CLS]"] and original[length - 1] == SPECIAL["[SEP]"]
        assert (original[:length] == SPECIAL["[SEP]"]).sum() == 2
        assert torch.all(ids[length:] == SPECIAL["[PAD]"]) and not pad[length:].any()
        assert types[0] == 0 and types[length - 1] == 1 and torch.all(types[length:] == 0)
        selected = item["loss_mask"] > 0
        assert not torch.isin(item["labels"][selected], torch.tensor([0, 1, 3])).any()  # never specials
        masked += int(selected.sum())
        replaced_by_mask += int((ids[selected] == SPECIAL["[MASK]"]).sum())
        kept += int((ids[selected] == item["labels"][selected]).sum())
        candidates += length - 3
        swapped += int(item["sentence_order"])
    assert masked / candidates == pytest.approx(0.15, abs=0.03)
    assert replaced_by_mask / masked == pytest.approx(0.8, abs=0.08)
    assert kept / masked == pytest.approx(0.1, abs=0.06)
    assert swapped / len(dataset) == pytest.approx(0.5, abs=0.2)


def test_samples_are_deterministic(sentence_prefix):
    a, b = bert_dataset(sentence_prefix, seed=3), bert_dataset(sentence_prefix, seed=3)
    for i in (0, 5, len(a) + 2):  # also in the next epoch
        assert all(torch.equal(a[i][k], b[i][k]) for k in a[i])
    other = bert_dataset(sentence_prefix, seed=4)
    assert not all(torch.equal(a[0][k], other[0][k]) for k in a[0])


def _config(stage: int, micro: int, invariant: bool = False) -> dict:
    """invariant: layout-invariant dropout masks (per sample and global head)."""
    zero = {"stage": stage, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 0}
    return base_config(train_micro_batch_size_per_gpu=micro, zero_optimization=zero,
                       dropout_masks={"layout_invariant": invariant})


@pytest.fixture(scope="module")
def reference(pools, sentence_prefix):
    """The single-process run with a given micro-batch size: the masked-LM loss is a mean over
    each micro-batch's masked tokens (as in Megatron), so layouts compare at equal micro-batches."""
    runs = {}

    def get(micro: int, invariant: bool) -> dict:
        if (micro, invariant) not in runs:
            runs[micro, invariant] = pools(1).run(train_bert, _config(0, micro, invariant), sentence_prefix, STEPS,
                                                  None)[0]
        return runs[micro, invariant]

    return get


# (name, world size, (TP, PP), ZeRO stage, micro-batch, layout-invariant masks), dropout 0.1 in all.
# Data-parallel layouts run the default masks: micro-batch i of a step draws the same masks at every
# DP size. Layouts with TP or PP run layout-invariant masks (and so does their reference): in the
# default mode attention dropout is drawn per TP rank inside the tensor-parallel region (Megatron's
# design), so no single process would draw their masks.
LAYOUTS = [("tp2", 2, (2, 1), 0, 8, True), ("pp2", 2, (1, 2), 1, 2, True), ("dp2_zero2", 2, (1, 1), 2, 4, False),
           ("dp2_zero3", 2, (1, 1), 3, 4, False), ("tp2_pp2", 4, (2, 2), 0, 2, True),
           ("tp2_dp2_zero1", 4, (2, 1), 1, 4, True)]


# context parallelism: (name, world size, (TP, PP), ZeRO stage, micro-batch, model overrides); the
# ring (p2p) takes attention dropout on layout-invariant masks only, and all-to-all runs them too
# (its default masks are drawn per head group, which no single process draws)
CP_LAYOUTS = [("cp2_p2p", 2, (1, 1), 0, 8, {"context_parallel_size": 2}),
              ("cp2_a2a_zero3_selective", 2, (1, 1), 3, 8, {"context_parallel_size": 2, "cp_comm_type": "a2a",
                                                             "recompute_granularity": "selective"}),
              ("cp2_tp2_sp", 4, (2, 1), 1, 8, {"context_parallel_size": 2, "sequence_parallel": True}),
              ("cp2_pp2", 4, (1, 2), 0, 8, {"context_parallel_size": 2})]


@pytest.mark.parametrize("name,world,layout,stage,micro,invariant", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_bert_layout_matches_single_process(pools, reference, sentence_prefix, name, world, layout, stage, micro,
                                            invariant):
    results = pools(world).run(train_bert, _config(stage, micro, invariant), sentence_prefix, STEPS, layout)
    _assert_matches(reference(micro, invariant), results)


@pytest.mark.parametrize("name,world,layout,stage,micro,overrides", CP_LAYOUTS, ids=[x[0] for x in CP_LAYOUTS])
def test_bert_context_parallel_matches_single_process(pools, reference, sentence_prefix, name, world, layout, stage,
                                                      micro, overrides):
    results = pools(world).run(train_bert, _config(stage, micro, True), sentence_prefix, STEPS, layout, overrides)
    _assert_matches(reference(micro, True), results)


def _assert_matches(reference: dict, results: list[dict]) -> None:
    for result in results:
        for step, (a, b) in enumerate(zip(reference["losses"], result["losses"])):
            assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: {reference['losses']} vs {result['losses']}"
        assert result["params"].keys() == reference["params"].keys()
        for key, value in reference["params"].items():
            torch.testing.assert_close(result["params"][key], value, rtol=0, atol=2e-5, msg=key)
    assert reference["losses"][-1] < reference["losses"][0]


def test_pre_layer_norm_variant_trains(pools, sentence_prefix):
    result = pools(1).run(train_bert, _config(0, 8), sentence_prefix, STEPS, None, {"post_layer_norm": False})[0]
    assert np.isfinite(result["losses"]).all() and result["losses"][-1] < result["losses"][0]


def test_export_to_transformers_bert(pools, sentence_prefix, tmp_path):
    """A BERT trained at TP=2 x PP=2 exports as a BertForPreTraining with the same MLM and sentence
    logits (fp32, within 1e-5)."""
    require_transformers()
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import BertForPreTraining

    from megazero.checkpoint.model_files import load_model
    from models.bert import Bert, BertConfig
    from scripts.export_hf import main as export
    from tests.bert_helpers import bert_dataset

    save = str(tmp_path / "ckpt")
    pools(4).run(train_bert, _config(1, 2), sentence_prefix, 2, (2, 2), None, save)
    export(["--load", save, "--out", str(tmp_path / "hf"), "--tokenizer-model", _bert_tokenizer(tmp_path)])
    hf = BertForPreTraining.from_pretrained(str(tmp_path / "hf")).eval()
    ours = load_model(save, model_class=Bert, config_class=BertConfig)
    samples = [bert_dataset(sentence_prefix)[i] for i in range(4)]
    batch = {k: torch.stack([s[k] for s in samples]) for k in ("input_ids", "token_type_ids", "padding_mask")}
    with torch.no_grad():
        mlm, sentence = ours.heads(ours.encode(batch["padding_mask"], batch["input_ids"], batch["token_type_ids"]))
        out = hf(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                 attention_mask=batch["padding_mask"].long())
    real = batch["padding_mask"]
    vocab = ours.config.vocab_size  # the export leaves the padding out; heads() returns the padded columns
    torch.testing.assert_close(out.prediction_logits[real], mlm[real][:, :vocab], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.seq_relationship_logits, sentence, rtol=1e-5, atol=1e-5)


def _bert_tokenizer(tmp_path) -> str:
    """A small sentencepiece model with the BERT pieces (export needs [PAD]'s id)."""
    from megazero.data import train_sentencepiece

    text = tmp_path / "text.txt"
    text.write_text("the king and the queen. a fool and a ghost!\n" * 200)
    return train_sentencepiece([str(text)], str(tmp_path / "tok"), 300, special_tokens=["[CLS]", "[SEP]", "[MASK]",
                                                                                      "[PAD]"])
