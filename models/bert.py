"""BERT: bidirectional encoder with a masked-LM head tied to the word embeddings and a two-way
sentence head (sentence-order prediction, or next-sentence prediction: the same shape).

Plain and meant to be forked, built like models/gpt.py: Megatron's tensor-parallel layers (plain
layers without a tp_group), one seed per layer so every shard and pipeline stage starts as the
slice of the single-process model, and `layers` / `pre_process` / `post_process` to build a
pipeline stage (chosen for each rank by models/parallelize.py). Post-LayerNorm (the original
BERT) or pre-LayerNorm blocks. Sequence parallelism (LayerNorm, dropout and residual activations
split along the sequence over the TP ranks) as in models/gpt.py. Context parallelism as GPT's:
each rank of the cp_group takes its chunks of every sample, attention (not causal: every query
sees every real token) spans the group, the padding mask is the whole sequence's.

Bert(config) is the plain model, without recomputation; Bert(config, speed_options=True), what
models/parallelize.py builds, runs the config's `recompute_granularity` (full: whole layers, the
first `recompute_num_layers` of each stage; selective: the attention core), as GPT. BERT has no
fused kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megazero import tensor_parallel as tp
from megazero.context_parallel.comm import broadcast_from_first
from megazero.tensor_parallel import invariant_dropout as keyed
from megazero.tensor_parallel.random import layer_stream
from megazero.tensor_parallel.utils import set_tensor_parallel_attributes
from models.common import (
    PLAIN,
    AttentionCore,
    ContextParallel,
    ModelConfig,
    SpeedOptions,
    StageContract,
    check_tp_group,
    dropout,
    normal_init,
    seeded,
    vocabulary_init,
)


@dataclass
class BertConfig(ModelConfig):
    """Model shape; the embedding is padded to a multiple of make_vocab_size_divisible_by x TP rows,
    invisibly (see models/common.py): the MLM loss covers vocab_size tokens only."""

    vocab_size: int = 8000  # tokens in the vocabulary (the recipes take the tokenizer's)
    seq_length: int = 128  # tokens per sample
    num_layers: int = 4  # transformer layers
    hidden_size: int = 256  # width of the residual stream
    num_attention_heads: int = 4  # attention heads (split over the tensor-parallel ranks)
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    dropout: float = 0.1  # dropout of attention probabilities and hidden states (Megatron's two: below)
    attention_dropout: float | None = None  # dropout of the attention probabilities (None: dropout)
    hidden_dropout: float | None = None  # dropout of the embeddings and each sublayer's output (None: dropout)
    init_method_std: float = 0.02  # std of the weights' normal initialisation
    max_position_embeddings: int | None = None  # rows of the position table (None: seq_length); >= seq_length
    layernorm_epsilon: float = 1e-5  # LayerNorm's epsilon
    make_vocab_size_divisible_by: int = 128  # the embedding's rows are padded to a multiple of this x TP (Megatron's)
    num_token_types: int = 2  # token types (segments) of the token-type embedding
    post_layer_norm: bool = True  # BERT's original; False: pre-LayerNorm blocks and a final LayerNorm
    binary_head: str = "sop"  # "sop" (sentence order) or "nsp" (next sentence): a 2-way head on [CLS]
    # run by Bert(config, speed_options=True), what models/parallelize.py builds (see the module docstring)
    recompute_granularity: str | None = None  # "full": whole layers; "selective": the attention core
    recompute_num_layers: int | None = None  # with "full": the first N layers of each stage (default: all)
    tensor_model_parallel_size: int = 1  # must equal the size of the tp_group the model is built with
    sequence_parallel: bool = False  # split LayerNorm/dropout activations along the sequence across TP ranks
    context_parallel_size: int = 1  # ranks each sample's sequence is split over (the cp_group's size)
    cp_comm_type: str = "p2p"  # context parallelism's attention: "p2p" (ring) or "a2a" (all-to-all, Ulysses)

    def __post_init__(self):
        self.check_positions()
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.binary_head not in ("sop", "nsp"):
            raise ValueError(f"binary_head must be 'sop' or 'nsp', got {self.binary_head!r}")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity must be 'full' or 'selective', got {self.recompute_granularity!r}")
        if self.recompute_num_layers is not None and self.recompute_granularity != "full":
            raise ValueError(f"recompute_num_layers {self.recompute_num_layers} needs recompute_granularity 'full', "
                             f"got {self.recompute_granularity!r}")
        self.check_tensor_parallel()
        self.check_context_parallel()
        if self.sequence_parallel and self.seq_length % self.tensor_model_parallel_size:
            raise ValueError(f"sequence_parallel: seq_length {self.seq_length} is not divisible by "
                             f"tensor_model_parallel_size {self.tensor_model_parallel_size}")


class SelfAttention(nn.Module):
    """Bidirectional multi-head attention over the non-padding tokens; this TP rank's heads."""

    def __init__(self, config: BertConfig, tp_group=None, layer: int = 0, speed: SpeedOptions = PLAIN,
                 context: ContextParallel | None = None):
        super().__init__()
        self.num_heads = config.num_attention_heads // config.tensor_model_parallel_size
        self.head_dim = config.hidden_size // config.num_attention_heads
        sp = config.sequence_parallel
        self.qkv = tp.ColumnParallelLinear(config.hidden_size, 3 * config.hidden_size, tp_group,
                                           init_method=normal_init(config.init_method_std), stride=3,
                                           sequence_parallel=sp)
        self.core = AttentionCore(config.attention_dropout_rate, layer, causal=False, recompute=speed.attention,
                                  context=context)
        self.proj = tp.RowParallelLinear(config.hidden_size, config.hidden_size, tp_group,
                                         init_method=normal_init(config.init_method_std), sequence_parallel=sp)

    def forward(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [batch, seq, 3 * local heads * head_dim] (the whole sequence under SP)
        batch, seq, _ = qkv.shape
        q, k, v = (t.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
        y = self.core(q, k, v, attend)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class Layer(nn.Module):
    """Attention and GeLU MLP, each with a residual: post-LN ln(x + f(x)) or pre-LN x + f(ln(x))."""

    def __init__(self, config: BertConfig, tp_group=None, layer: int = 0, speed: SpeedOptions = PLAIN,
                 context: ContextParallel | None = None):
        super().__init__()
        self.post_ln = config.post_layer_norm
        sp = self.sequence_parallel = config.sequence_parallel
        self.ln_1 = tp.LayerNorm(config.hidden_size, config.layernorm_epsilon, tp_group, sp, speed.fused_kernels)
        self.attn = SelfAttention(config, tp_group, layer, speed, context)
        self.ln_2 = tp.LayerNorm(config.hidden_size, config.layernorm_epsilon, tp_group, sp, speed.fused_kernels)
        self.fc = tp.ColumnParallelLinear(config.hidden_size, config.ffn_hidden_size, tp_group,
                                          init_method=normal_init(config.init_method_std), sequence_parallel=sp)
        self.proj = tp.RowParallelLinear(config.ffn_hidden_size, config.hidden_size, tp_group,
                                         init_method=normal_init(config.init_method_std), sequence_parallel=sp)
        self.dropout = config.hidden_dropout_rate
        self.layer = layer  # in the whole model: keys the layout-invariant dropout masks
        self.recompute = speed.layer

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))

    def forward(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        return self.recompute(self.compute, x, attend)

    def compute(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """The layer itself (forward adds only the recomputation)."""
        drop = lambda y, site: dropout(y, self.dropout, self.training, self.layer, site,  # noqa: E731
                                       self.sequence_parallel)
        if self.post_ln:
            x = self.ln_1(x + drop(self.attn(x, attend), keyed.ATTENTION_OUTPUT))
            return self.ln_2(x + drop(self._mlp(x), keyed.MLP_OUTPUT))
        x = x + drop(self.attn(self.ln_1(x), attend), keyed.ATTENTION_OUTPUT)
        return x + drop(self._mlp(self.ln_2(x)), keyed.MLP_OUTPUT)


class Bert(StageContract, nn.Module):
    """BERT for pretraining. forward(...) -> masked-LM loss + sentence loss (see `losses`).

    Batch keys: input_ids, token_type_ids, padding_mask (True for real tokens), labels (original
    ids at masked positions), loss_mask (1.0 where a token was masked), sentence_order (0/1).
    tp_group, layers, pre_process, post_process, speed_options, cp_group: as GPT's (models/gpt.py).
    """

    def __init__(self, config: BertConfig, tp_group=None, layers: range | None = None, pre_process: bool = True,
                 post_process: bool = True, speed_options: bool = False, cp_group=None):
        super().__init__()
        check_tp_group(config, tp_group)
        self.config, self.tp_group = config, tp_group
        self.context = ContextParallel.of(config, cp_group)
        self.layers = layers if layers is not None else range(config.num_layers)
        self.pre_process, self.post_process = pre_process, post_process
        h, eps = config.hidden_size, config.layernorm_epsilon
        base_seed = int(torch.randint(0, 2**31 - 1, (1,), device="cpu"))
        with seeded(base_seed):
            # the MLM output layer is tied to the word embedding: a last stage holds a copy (kept equal
            # by summing both copies' gradients, see tied_parameters) built from the same seed as the
            # first stage's
            self.wte = tp.VocabParallelEmbedding(config.padded_vocab_size, h, tp_group,
                                                 init_method=vocabulary_init(config.init_method_std, config.vocab_size))
            if pre_process:
                self.wpe = nn.Embedding(config.max_position_embeddings or config.seq_length, h)
                self.tte = nn.Embedding(config.num_token_types, h)
                nn.init.normal_(self.wpe.weight, std=config.init_method_std)
                nn.init.normal_(self.tte.weight, std=config.init_method_std)
                self.ln_emb = nn.LayerNorm(h, eps=eps)
        blocks = []
        for position, i in enumerate(self.layers):
            speed = SpeedOptions.of(config, position) if speed_options else PLAIN
            with seeded(base_seed + 1 + i):
                blocks.append(Layer(config, tp_group, i, speed, self.context))
        self.blocks = nn.ModuleList(blocks)
        if post_process:
            with seeded(base_seed + 1 + config.num_layers):
                self._build_heads(config)

    @staticmethod
    def example_batch(config: BertConfig, micro_batch_size: int) -> dict[str, torch.Tensor]:
        """A micro-batch of `micro_batch_size` random sequences with every key forward takes (the
        measured stage split times the stages on it): no padding, ~15% of the tokens masked; its
        own generator, so drawing it moves no other."""
        generator = torch.Generator()
        shape = (micro_batch_size, config.seq_length)
        ids = torch.randint(0, config.vocab_size, shape, generator=generator)
        return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids),
                "padding_mask": torch.ones(shape, dtype=torch.bool), "labels": ids,
                "loss_mask": (torch.rand(shape, generator=generator) < 0.15).float(),
                "sentence_order": torch.randint(0, 2, (micro_batch_size,), generator=generator)}

    def _build_heads(self, config: BertConfig) -> None:
        h, eps = config.hidden_size, config.layernorm_epsilon
        if not config.post_layer_norm:
            self.ln_f = tp.LayerNorm(h, eps, self.tp_group, config.sequence_parallel)
        self.lm_dense = nn.Linear(h, h)
        self.lm_ln = tp.LayerNorm(h, eps, self.tp_group, config.sequence_parallel)
        # the output bias is split over the vocabulary like the tied output weight
        self.lm_bias = nn.Parameter(torch.zeros(config.padded_vocab_size // config.tensor_model_parallel_size))
        set_tensor_parallel_attributes(self.lm_bias, 0)
        self.pooler = nn.Linear(h, h)
        self.binary = nn.Linear(h, 2)
        for linear in (self.lm_dense, self.pooler, self.binary):
            nn.init.normal_(linear.weight, std=config.init_method_std)
            nn.init.zeros_(linear.bias)

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        """Word + position + token-type embeddings, LayerNorm, dropout (this rank's tokens, at
        their global positions, under context parallelism)."""
        seq = input_ids.shape[1]
        if seq > self.config.seq_length:
            raise ValueError(f"sequence of {seq} tokens is longer than seq_length {self.config.seq_length}")
        if self.context is not None:
            positions = self.context.positions(seq, input_ids.device)
            input_ids, token_type_ids = self.context.split(input_ids), self.context.split(token_type_ids)
        else:
            positions = torch.arange(seq, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions) + self.tte(token_type_ids)
        x = self.ln_emb(x)
        if self.config.sequence_parallel:
            x = tp.scatter_to_sequence_parallel_region(x, self.tp_group)
        return dropout(x, self.config.hidden_dropout_rate, self.training, 0, keyed.EMBEDDING,
                       self.config.sequence_parallel)

    def encode(self, padding_mask: torch.Tensor, input_ids=None, token_type_ids=None,
               hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's layers over the embeddings (first stage) or the previous stage's output
        (this rank's slice of the sequence under sequence parallelism)."""
        x = self.embed(input_ids, token_type_ids) if self.pre_process else hidden_states
        attend = padding_mask.bool()[:, None, None, :]  # every query sees the real tokens
        for layer, block in zip(self.layers, self.blocks):
            layer_stream(layer)  # the layer's dropout masks, whichever stage runs it
            x = block(x, attend)
        return x

    def _cls_token(self, x: torch.Tensor) -> torch.Tensor:
        """[CLS]'s hidden state on every TP and CP rank. Under context parallelism it lives on CP
        rank 0 (chunk 0 comes first) and is broadcast over the group, whose backward sums the CP
        ranks' gradients (each computes its own share of the loss). Under sequence parallelism it
        lives on TP rank 0: the other ranks add zeros, and the backward hands the pooler's
        gradient to rank 0 only (TP ranks compute the same loss)."""
        first = x[:, 0]
        if self.context is not None:
            first = broadcast_from_first(first, self.context.group)
        if not self.config.sequence_parallel:
            return first
        rank = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        return tp.reduce_from_tensor_parallel_region(first if rank == 0 else torch.zeros_like(first), self.tp_group)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this TP rank's slice of the padded vocabulary's MLM logits, the 2-way sentence logits)."""
        if not self.config.post_layer_norm:
            x = self.ln_f(x)
        sentence = self.binary(torch.tanh(self.pooler(self._cls_token(x))))
        if self.config.sequence_parallel:  # lm_dense sees part of the tokens: its gradient is summed over TP
            dense = F.linear(x, tp.sync_replicated_grad(self.lm_dense.weight, self.tp_group),
                             tp.sync_replicated_grad(self.lm_dense.bias, self.tp_group))
            hidden = tp.gather_from_sequence_parallel_region(self.lm_ln(F.gelu(dense)), self.tp_group)
        else:
            hidden = tp.copy_to_tensor_parallel_region(self.lm_ln(F.gelu(self.lm_dense(x))), self.tp_group)
        logits = F.linear(hidden, self.wte.weight, self.lm_bias)
        return logits, sentence

    def losses(self, input_ids=None, token_type_ids=None, padding_mask=None, labels=None, loss_mask=None,
               sentence_order=None, hidden_states=None) -> dict[str, torch.Tensor]:
        """{'mlm': masked-LM loss, 'sop': sentence loss, 'sop_correct': right answers} (last stage;
        under context parallelism 'mlm' is this rank's share: the CP ranks' mean is the loss)."""
        logits, sentence = self.heads(self.encode(padding_mask, input_ids, token_type_ids, hidden_states))
        masked_tokens = loss_mask.float().sum().clamp(min=1.0)
        if self.context is not None:
            masked_tokens = self.context.loss_tokens(loss_mask)
            labels, loss_mask = self.context.split(labels), self.context.split(loss_mask)
        per_token = tp.vocab_parallel_cross_entropy(logits, labels, self.tp_group, vocab_size=self.config.vocab_size)
        mlm = (per_token * loss_mask.float()).sum() / masked_tokens
        sop = F.cross_entropy(sentence.float(), sentence_order)
        return {"mlm": mlm, "sop": sop, "sop_correct": (sentence.argmax(-1) == sentence_order).sum()}

    def forward(self, input_ids=None, token_type_ids=None, padding_mask=None, labels=None, loss_mask=None,
                sentence_order=None, hidden_states=None) -> torch.Tensor:
        if not self.post_process:
            return self.encode(padding_mask, input_ids, token_type_ids, hidden_states)
        out = self.losses(input_ids, token_type_ids, padding_mask, labels, loss_mask, sentence_order, hidden_states)
        return out["mlm"] + out["sop"]

