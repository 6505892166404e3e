"""Documents packed in a sample (--reset-position-ids, --reset-attention-mask, --eod-mask-loss): the
fields equal Megatron's get_ltor_masks_and_position_ids, and a packed sample's per-document logits
equal each document's own forward (GPT and Llama), which the plain causal mask does not give."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.data.packing import DocumentPacking
from megazero.tensor_parallel.invariant_dropout import softmax_attention
from models.common import Documents
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from tests.training_helpers import NO_DROPOUT, TINY, TINY_LLAMA

EOD = 7


def megatron_fields(data: torch.Tensor, eod: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(attention mask [s, s] bool, position ids, loss mask) as Megatron-LM's
    get_ltor_masks_and_position_ids computes them with all three flags on (its loop, one sample)."""
    s = len(data)
    attention = torch.tril(torch.ones(s, s)).bool()
    loss_mask = torch.ones(s)
    loss_mask[data == eod] = 0.0
    position_ids = torch.arange(s)
    prev_index = 0
    for i in torch.arange(s)[data == eod].tolist():
        attention[i + 1:, :i + 1] = False
        position_ids[i + 1:] -= i + 1 - prev_index
        prev_index = i + 1
    return attention, position_ids, loss_mask


@pytest.mark.parametrize("tokens", [[1, 2, EOD, 3, 4, 5, EOD, 6], [EOD, 1, 2, 3, 4, 5, 6, EOD], [1, 2, 3, 4, 5, 6],
                                    [EOD, EOD, 1, EOD, 2, 3, EOD, EOD]])
def test_fields_are_megatrons(tokens):
    data = torch.tensor(tokens)
    attention, positions, loss_mask = megatron_fields(data, EOD)
    fields = DocumentPacking(EOD, True, True, True).fields(data)
    assert torch.equal(fields["position_ids"], positions)
    assert torch.equal(fields["loss_mask"], loss_mask)
    same_document = fields["document_ids"][:, None] == fields["document_ids"][None, :]
    assert torch.equal(same_document & torch.ones(len(data), len(data), dtype=torch.bool).tril(), attention)
    assert torch.equal(Documents.of(fields["document_ids"][None]).mask(data.device)[0, 0], attention)
    assert DocumentPacking(EOD, eod_mask_loss=True).fields(data).keys() == {"loss_mask"}
    assert not DocumentPacking(EOD).enabled


def _model(family: str) -> tuple[torch.nn.Module, dict]:
    """A seeded tiny GPT or Llama without dropout, in eval mode, and its shape."""
    families = {"gpt": (GPTConfig, TINY, GPT), "llama": (LlamaConfig, TINY_LLAMA, Llama)}
    config_class, shape, model_class = families[family]
    torch.manual_seed(0)
    return model_class(config_class(**{**shape, **NO_DROPOUT})).eval(), shape


def _documents(seq: int, vocab: int, seed: int) -> list[torch.Tensor]:
    """Documents ending with EOD (the last one cut by the window) filling `seq` tokens."""
    generator = torch.Generator().manual_seed(seed)
    docs, used = [], 0
    while used < seq:
        length = min(int(torch.randint(3, seq // 2, (1,), generator=generator)), seq - used)
        doc = torch.randint(EOD + 1, vocab, (length,), generator=generator)
        if used + length < seq:
            doc[-1] = EOD
        docs.append(doc)
        used += length
    return docs


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_packed_samples_logits_are_each_documents_own(family):
    model, shape = _model(family)
    seq = shape["seq_length"]
    rows = [_documents(seq, shape["vocab_size"], seed) for seed in (1, 2)]
    ids = torch.stack([torch.cat(docs) for docs in rows])
    packing = DocumentPacking(EOD, reset_position_ids=True, reset_attention_mask=True)
    fields = {k: torch.stack([packing.fields(row)[k] for row in ids]) for k in ("position_ids", "document_ids")}
    with torch.no_grad():
        packed = model(ids, **fields)
        plain = model(ids)
        for b, docs in enumerate(rows):
            start = 0
            for doc in docs:
                alone = model(doc[None])[0]
                torch.testing.assert_close(packed[b, start:start + len(doc)], alone, rtol=1e-5, atol=1e-5)
                start += len(doc)
    later = rows[0][0].shape[0]  # the second document onwards sees the first under the plain causal mask
    assert (plain[0, later:] - packed[0, later:]).abs().max() > 1e-2
    torch.testing.assert_close(plain[0, :later], packed[0, :later], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_eod_mask_loss_leaves_the_boundary_predictions_out(family):
    model, shape = _model(family)
    chunk = torch.cat(_documents(shape["seq_length"] + 1, shape["vocab_size"], 3))
    ids, labels = chunk[None, :-1], chunk[None, 1:]
    loss_mask = DocumentPacking(EOD, eod_mask_loss=True).fields(ids[0])["loss_mask"][None]
    assert 0 < loss_mask.sum() < loss_mask.numel()
    with torch.no_grad():
        per_token = F.cross_entropy(model(ids)[0], labels[0], reduction="none")
        expected = (per_token * loss_mask[0]).sum() / loss_mask.sum()
        torch.testing.assert_close(model(ids, labels, loss_mask=loss_mask), expected, rtol=1e-6, atol=1e-6)
        assert abs(float(model(ids, labels)) - float(expected)) > 1e-4


def test_the_written_out_mask_path_equals_the_per_document_kernels():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=generator)
    k, v = torch.randn(2, 2, 16, 8, generator=generator), torch.randn(2, 2, 16, 8, generator=generator)
    document_ids = torch.tensor([[0] * 5 + [1] * 9 + [2] * 2, [0] * 16])
    documents = Documents.of(document_ids)
    assert documents.spans == (((0, 5), (5, 14), (14, 16)), ((0, 16),))
    torch.testing.assert_close(softmax_attention(q, k, v, documents.mask(q.device)), documents.attention(q, k, v, 0.0),
                               rtol=1e-5, atol=1e-5)
