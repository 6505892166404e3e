"""The speed options `parallelize` builds the models with (models/parallelize.py, speed_options=True:
models.common.SpeedOptions): recomputation and fused kernels. GPT(config) / Bert(config) built
directly recompute nothing and run torch's kernels whatever the config says; parallelize(config)
recomputes what the config asks (the first N layers, or the attention cores) and fuses GPT's
LayerNorms and bias + GeLU, each module choosing at construction, none with a `forward` of its
own instance. Neither changes a parameter name, the state dict or the model contract's global
names, and on the CPU the fused model computes exactly the plain one."""

from __future__ import annotations

import pytest
import torch

import megazero.activation_checkpointing as ac
from megazero import tensor_parallel as tp
from megazero.tensor_parallel.random import get_rng_tracker
from models.bert import Bert, BertConfig
from models.gpt import GPT, MLP, GPTConfig
from models.parallelize import parallelize

SHAPE = dict(vocab_size=256, seq_length=16, num_layers=3, hidden_size=32, num_attention_heads=4,
             make_vocab_size_divisible_by=64, dropout=0.1)


def _built(build, config):
    torch.manual_seed(0)
    return build(config)


def _ids() -> torch.Tensor:
    """A fixed batch of 2 sequences (inputs and shifted labels)."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, SHAPE["vocab_size"], (2, SHAPE["seq_length"] + 1), generator=generator)


def _checkpoints(model: torch.nn.Module) -> int:
    """Checkpointed forwards in one forward/backward of `model` on a GPT batch."""
    get_rng_tracker().reset()
    ids = _ids()
    ac.configure()
    try:
        model(ids[:, :-1], ids[:, 1:]).backward()
        return ac.checkpoint_stats()["forwards"]
    finally:
        ac.configure()


@pytest.mark.parametrize("granularity, layers, expected", [("full", None, 3), ("full", 1, 1), ("selective", None, 3)])
def test_gpt_built_directly_recomputes_nothing_parallelize_recomputes_what_the_config_asks(granularity, layers,
                                                                                           expected):
    config = GPTConfig(**SHAPE, recompute_granularity=granularity, recompute_num_layers=layers)
    assert _checkpoints(_built(GPT, config)) == 0
    assert _checkpoints(_built(parallelize, config)) == expected


def test_which_modules_recompute():
    full = _built(parallelize, GPTConfig(**SHAPE, recompute_granularity="full", recompute_num_layers=2))
    assert [b.recompute.enabled for b in full.blocks] == [True, True, False]
    assert not any(b.attn.core.recompute.enabled for b in full.blocks)
    selective = _built(parallelize, BertConfig(**SHAPE, recompute_granularity="selective"))
    assert all(b.attn.core.recompute.enabled for b in selective.blocks)
    assert not any(b.recompute.enabled for b in selective.blocks)
    assert not any("forward" in m.__dict__ for model in (full, selective) for m in model.modules())


def test_no_recompute_without_gradients():
    model = _built(parallelize, GPTConfig(**SHAPE, recompute_granularity="full"))
    ids = torch.randint(0, SHAPE["vocab_size"], (2, SHAPE["seq_length"]))
    ac.configure()
    try:
        with torch.no_grad():
            model(ids)
        assert ac.checkpoint_stats()["forwards"] == 0
    finally:
        ac.configure()


def test_fused_kernels_are_chosen_by_the_modules_parallelize_builds():
    fused = _built(parallelize, GPTConfig(**SHAPE))  # fused_kernels defaults to True
    norms = [m for m in fused.modules() if isinstance(m, tp.LayerNorm)]
    assert len(norms) == 2 * SHAPE["num_layers"] + 1 and all(m.fused for m in norms)
    assert all(type(b.mlp) is MLP and b.mlp.fused for b in fused.blocks)
    for model in (_built(GPT, GPTConfig(**SHAPE)), _built(parallelize, GPTConfig(**SHAPE, fused_kernels=False)),
                  _built(parallelize, BertConfig(**SHAPE))):
        assert not any(m.fused for m in model.modules() if isinstance(m, (tp.LayerNorm, MLP)))
    assert all(type(b.mlp) is MLP for b in _built(GPT, GPTConfig(**SHAPE)).blocks)


@pytest.mark.parametrize("config", [GPTConfig(**SHAPE, recompute_granularity="full"),
                                    GPTConfig(**SHAPE, recompute_granularity="selective"),
                                    BertConfig(**SHAPE, recompute_granularity="full", recompute_num_layers=2),
                                    BertConfig(**SHAPE, recompute_granularity="selective")],
                         ids=["gpt_full", "gpt_selective", "bert_full", "bert_selective"])
def test_names_and_state_dict_are_the_plain_models(config):
    plain = _built(GPT if isinstance(config, GPTConfig) else Bert, config)
    built = _built(parallelize, config)
    assert [n for n, _ in built.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert [built.global_parameter_name(n) for n, _ in built.named_parameters()] == \
        [plain.global_parameter_name(n) for n, _ in plain.named_parameters()]
    assert list(built.state_dict()) == list(plain.state_dict())
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in built.state_dict().items())


def test_on_the_cpu_the_fused_recomputed_gpt_computes_the_plain_one_bit_for_bit():
    config = GPTConfig(**SHAPE, recompute_granularity="full")
    ids = _ids()
    results = []
    for build in (GPT, parallelize):
        model = _built(build, config)
        get_rng_tracker().reset()
        torch.manual_seed(2)  # the dropout masks
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (plain_loss, plain_grads), (loss, grads) = results
    assert torch.equal(plain_loss, loss)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads))
