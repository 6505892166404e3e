"""Adding a model is its file plus one line in models/parallelize.py's MODELS: a small model defined
here, registered with that one line, is built by `parallelize` (one process, with its speed
options), and split into pipeline stages by both partition methods, whose weights come from the
model itself (its parameter shapes on the meta device), not from a table; every registered model,
BERT included, can be timed for the measured split on its own example_batch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megazero import tensor_parallel as tp
from megazero.pipeline.partition import balanced_stage_layers
from megazero.tensor_parallel import invariant_dropout as keyed
from models import parallelize as registry
from models.bert import BertConfig
from models.common import (
    PLAIN,
    AttentionCore,
    ModelConfig,
    SpeedOptions,
    StageContract,
    causal_lm_batch,
    dropout,
    seeded,
    vocabulary_init,
)
from models.gpt import GPTConfig
from models.llama import LlamaConfig


@dataclass
class TinyConfig(ModelConfig):
    """A causal LM with a one-matrix MLP: small, and shaped unlike GPT, Llama and BERT."""

    vocab_size: int = 256
    seq_length: int = 8
    num_layers: int = 6
    hidden_size: int = 16
    num_attention_heads: int = 2
    ffn_hidden_size: int = 16
    dropout: float = 0.1
    make_vocab_size_divisible_by: int = 32
    recompute_granularity: str | None = None
    recompute_num_layers: int | None = None
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False


class TinyLayer(nn.Module):
    """x + drop(attn(norm(x))) + drop(relu(fc(norm(x)))): attention and MLP in parallel."""

    def __init__(self, config: TinyConfig, layer: int, speed: SpeedOptions = PLAIN):
        super().__init__()
        h = config.hidden_size
        self.heads, self.layer, self.p = config.num_attention_heads, layer, config.dropout
        self.norm = tp.LayerNorm(h, fused=speed.fused_kernels)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.core = AttentionCore(config.dropout, layer, recompute=speed.attention)
        self.fc = nn.Linear(h, h, bias=False)
        self.recompute = speed.layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.recompute(self.compute, x)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        batch, seq, h = y.shape
        q, k, v = (t.view(batch, seq, self.heads, h // self.heads).transpose(1, 2) for t in self.qkv(y).chunk(3, -1))
        attended = self.core(q, k, v).transpose(1, 2).reshape(batch, seq, h)
        return (x + dropout(attended, self.p, self.training, self.layer, keyed.ATTENTION_OUTPUT)
                + dropout(F.relu(self.fc(y)), self.p, self.training, self.layer, keyed.MLP_OUTPUT))


class Tiny(StageContract, nn.Module):
    """The model contract as GPT holds it: `blocks` are the config's layers `layers`, the first
    stage embeds, the last holds the final norm and the output layer tied to the embedding."""

    def __init__(self, config: TinyConfig, tp_group=None, layers: range | None = None, pre_process: bool = True,
                 post_process: bool = True, speed_options: bool = False):
        super().__init__()
        self.config, self.tp_group = config, tp_group
        self.layers = layers if layers is not None else range(config.num_layers)
        self.pre_process, self.post_process = pre_process, post_process
        base_seed = int(torch.randint(0, 2**31 - 1, (1,), device="cpu"))
        with seeded(base_seed):
            self.wte = tp.VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size, tp_group,
                                                 init_method=vocabulary_init(0.02, config.vocab_size))
        blocks = []
        for position, i in enumerate(self.layers):
            with seeded(base_seed + 1 + i):
                blocks.append(TinyLayer(config, i, SpeedOptions.of(config, position) if speed_options else PLAIN))
        self.blocks = nn.ModuleList(blocks)
        if post_process:
            self.norm_f = tp.LayerNorm(config.hidden_size)

    example_batch = staticmethod(causal_lm_batch)

    def forward(self, input_ids=None, labels=None, hidden_states=None) -> torch.Tensor:
        x = self.wte(input_ids) if self.pre_process else hidden_states
        for block in self.blocks:
            x = block(x)
        if not self.post_process:
            return x
        logits = F.linear(self.norm_f(x), self.wte.weight)[..., :self.config.vocab_size]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@pytest.fixture
def registered(monkeypatch):
    """The one line a new model adds to models/parallelize.py."""
    monkeypatch.setitem(registry.MODELS, TinyConfig, Tiny)


def _grid(pp: int, pp_rank: int):
    from megazero.parallel_state import ParallelGrid

    return ParallelGrid(1, pp, 1, 0, pp_rank, 0, None, None, None, None, None, list(range(pp)))


def test_a_registered_model_is_built_and_trains_with_its_speed_options(registered):
    config = TinyConfig(recompute_granularity="full", recompute_num_layers=2)
    assert registry.model_class(config) is Tiny
    assert registry.config_class_for(config.to_dict()) is TinyConfig
    torch.manual_seed(0)
    model = registry.parallelize(config)
    torch.manual_seed(0)
    plain = Tiny(config)
    assert isinstance(model, Tiny) and [b.recompute.enabled for b in model.blocks] == [True, True] + [False] * 4
    assert not any(b.recompute.enabled for b in plain.blocks)
    assert list(model.state_dict()) == list(plain.state_dict())
    batch = causal_lm_batch(config, 2)
    losses = []
    for built in (model, plain):
        torch.manual_seed(1)  # the same dropout masks
        loss = built(**batch)
        loss.backward()
        losses.append((loss.detach(), [p.grad for p in built.parameters()]))
    assert torch.equal(losses[0][0], losses[1][0]) and math.isfinite(losses[0][0].item())
    assert all(torch.equal(a, b) for a, b in zip(losses[0][1], losses[1][1]))


def test_a_registered_model_is_split_by_its_own_parameters_and_flops(registered):
    config = TinyConfig()
    h, s, vocab = config.hidden_size, config.seq_length, config.padded_vocab_size
    layer_params = 2 * h + 3 * h * h + h * h  # norm, qkv, fc
    assert registry.stage_weights(config) == ([layer_params] * 6, vocab * h, vocab * h + 2 * h)
    layer_flops = 2 * (3 * h * h + h * h) * s + 4 * h * s * s
    head_flops = (2 * vocab * h + 5 * vocab) * s  # the tied output layer and the loss
    assert registry.stage_weights(config, "compute") == ([layer_flops] * 6, 0, head_flops)
    # the embedding and its tied copy weigh ~4 layers' parameters each: an even split; the head
    # costs ~3.7 layers' FLOPs and the embedding lookup none: the last stage gets one layer
    assert registry.stage_layers(config, 2) == [range(0, 3), range(3, 6)]
    assert registry.stage_layers(config, 2, "compute") == [range(0, 5), range(5, 6)]
    assert registry.stage_layers(config, 3, "compute") == balanced_stage_layers([layer_flops] * 6, 3, 0, head_flops)
    for rank, layers in enumerate(registry.stage_layers(config, 2, "compute")):
        stage = registry.parallelize(config, _grid(2, rank), partition_method="compute")
        assert isinstance(stage, Tiny) and stage.layers == layers
        assert (stage.pre_process, stage.post_process) == (rank == 0, rank == 1)


SHAPE = dict(vocab_size=256, seq_length=8, num_layers=4, hidden_size=16, num_attention_heads=2,
             make_vocab_size_divisible_by=32)


@pytest.mark.parametrize("config", [TinyConfig(), GPTConfig(**SHAPE), LlamaConfig(**SHAPE), BertConfig(**SHAPE)],
                         ids=["tiny", "gpt", "llama", "bert"])
def test_the_measured_split_times_every_model_on_its_example_batch(registered, config):
    split = registry.stage_layers(config, 2, "measured")
    assert [i for r in split for i in r] == list(range(config.num_layers)) and all(len(r) for r in split)


def test_an_unregistered_config_is_refused_naming_the_registry():
    with pytest.raises(TypeError, match="MODELS knows"):
        registry.parallelize(TinyConfig())
