"""Llama: rotary positions, pre-RMSNorm blocks, SwiGLU MLP, grouped-query causal attention, no
biases, an output layer of its own (untied from the word embedding by default).

Plain and meant to be forked, like models/gpt.py. Sizes come from LlamaConfig; configs/ holds a
CPU-sized default and Llama-style 1B / 7B / 13B shapes.

Grouped-query attention: num_attention_heads query heads share num_query_groups key/value heads
(each group serves num_attention_heads / num_query_groups consecutive query heads; 1 group is
multi-query attention, as many groups as heads is plain multi-head attention). Under tensor
parallelism each rank computes its share of the query heads; the key/value heads are split over
the ranks too when num_query_groups % TP == 0 (rank r holds the groups its query heads read), and
are otherwise computed whole on every rank (tp.ReplicatedLinear: gradients summed over the ranks),
each rank taking the groups of its own query heads.

As in GPT, the linear layers are Megatron's column/row-parallel ones (plain Linear layers without
a tp_group), a pipeline stage is this class built with `layers=range(first, last)` and without the
embedding (`pre_process=False`) or the head (`post_process=False`), and each layer is initialised
from its own seed, so every stage and shard starts as the slice of the single-process model.
Llama(config) is the plain model; Llama(config, speed_options=True), what models/parallelize.py
builds, runs the config's recomputation and fused RMSNorm (models.common.SpeedOptions), as GPT.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megazero import tensor_parallel as tp
from megazero.moe import MoELayer, attached_aux_loss
from megazero.tensor_parallel import invariant_dropout as keyed
from megazero.tensor_parallel.random import layer_stream
from megazero.tensor_parallel.weight_grad import linear as splittable_linear
from models.common import (
    PLAIN,
    AttentionCore,
    ContextParallel,
    Documents,
    ModelConfig,
    SpeedOptions,
    StageContract,
    causal_lm_batch,
    causal_lm_loss,
    check_moe,
    check_tp_group,
    dropout,
    moe_layer_config,
    moe_stats_group,
    normal_init,
    seeded,
    vocabulary_init,
)
from models.generation import CausalLMGeneration


@dataclass
class LlamaConfig(ModelConfig):
    """Model shape. The embedding (and the output layer) are padded to a multiple of
    `make_vocab_size_divisible_by` x TP rows, invisibly (see models/common.py)."""

    vocab_size: int = 8000  # tokens in the vocabulary (the recipes take the tokenizer's)
    seq_length: int = 256  # tokens per sample
    num_layers: int = 6  # transformer layers
    hidden_size: int = 384  # width of the residual stream
    num_attention_heads: int = 6  # attention heads (split over the tensor-parallel ranks)
    num_query_groups: int | None = None  # key/value heads; default num_attention_heads (no grouping)
    ffn_hidden_size: int | None = None  # SwiGLU width; default 8/3 x hidden_size rounded up to 64
    rope_theta: float = 10000.0  # base of the rotary embedding's frequencies (Megatron's --rotary-base)
    norm_epsilon: float = 1e-5  # RMSNorm's epsilon
    dropout: float = 0.0  # Llama trains without; here as GPT has it (attention, residuals, embedding)
    attention_dropout: float | None = None  # dropout of the attention probabilities (None: dropout)
    hidden_dropout: float | None = None  # dropout of the embeddings and each sublayer's output (None: dropout)
    init_method_std: float = 0.02  # std of the weights' normal init; output layers' std / sqrt(2 x num_layers)
    max_position_embeddings: int | None = None  # Megatron's longest sequence: >= seq_length (rotary: no table)
    untie_embeddings_and_output_weights: bool = True  # False: the output layer is the word embedding
    make_vocab_size_divisible_by: int = 128  # the embedding's rows are padded to a multiple of this x TP (Megatron's)
    # run by Llama(config, speed_options=True), what models/parallelize.py builds
    recompute_granularity: str | None = None  # "full": whole layers; "selective": the attention core
    recompute_num_layers: int | None = None  # with "full": the first N layers of each stage (default: all)
    fused_kernels: bool = True  # megazero's fused RMSNorm: CUDA kernel on GPUs, C++ op on CPUs (where built)
    tensor_model_parallel_size: int = 1  # must equal the size of the tp_group the model is built with
    sequence_parallel: bool = False  # split RMSNorm/dropout activations along the sequence across TP ranks
    context_parallel_size: int = 1  # ranks each sample's sequence is split over (the cp_group's size)
    cp_comm_type: str = "p2p"  # context parallelism's attention: "p2p" (ring) or "a2a" (all-to-all, Ulysses)
    # mixture of experts (Megatron's flags): every moe_layer_freq-th layer (0, freq, ...) has num_experts
    # experts in place of its MLP (megazero/moe/); None: the dense model
    num_experts: int | None = None  # experts per MoE layer; None: the dense model
    moe_router_topk: int = 2  # experts each token is routed to (1 or 2)
    moe_layer_freq: int = 1  # every Nth layer (0, N, 2N, ...) is an MoE layer
    moe_capacity_factor: float | None = None  # None: dropless
    moe_aux_loss_coeff: float = 0.01  # load-balancing loss weight, added to the training loss
    moe_z_loss_coeff: float = 0.0  # router z-loss weight
    # the router's weights (megazero/moe/router.py): "softmax_topk" (softmax over all experts, the k
    # largest, not renormalised) or "topk_softmax" (softmax over the k largest logits: Mixtral's)
    moe_router_score_order: str = "softmax_topk"

    def __post_init__(self):
        self.check_positions()
        heads = self.num_attention_heads
        if self.hidden_size % heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {heads}")
        if (self.hidden_size // heads) % 2:
            raise ValueError(f"the head size {self.hidden_size // heads} must be even for rotary embeddings")
        if self.num_query_groups is None:
            self.num_query_groups = heads
        if not 0 < self.num_query_groups <= heads or heads % self.num_query_groups:
            raise ValueError(f"num_attention_heads {heads} is not divisible by num_query_groups "
                             f"{self.num_query_groups}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = -(-8 * self.hidden_size // 3 // 64) * 64
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity must be 'full' or 'selective', got {self.recompute_granularity!r}")
        self.check_tensor_parallel()
        self.check_context_parallel()
        check_moe(self)
        if self.sequence_parallel and self.seq_length % self.tensor_model_parallel_size:
            raise ValueError(f"sequence_parallel: seq_length {self.seq_length} is not divisible by "
                             f"tensor_model_parallel_size {self.tensor_model_parallel_size}")

    @property
    def kv_heads_split(self) -> bool:
        """True when the key/value heads split over the TP ranks (else every rank computes them all)."""
        return self.num_query_groups % self.tensor_model_parallel_size == 0


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of x [batch, heads, seq, head_dim] at `positions` ([seq], or
    [batch, seq]: packed documents' own positions): each pair (x_i, x_{i + head_dim/2}) turned by
    the angle position x theta^(-2i/head_dim) (the half-split pairing of Hugging Face's Llama, so
    its q/k weights need no permutation)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=x.device).float() / dim))
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    if positions.dim() == 2:  # [batch, seq, head_dim] -> one angle per sample, shared by the heads
        angles = angles.unsqueeze(1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class GroupedQueryAttention(nn.Module):
    """Causal self-attention with rotary positions and num_query_groups key/value heads; this TP
    rank computes its share of the query heads (see the module docstring for the key/value heads)."""

    def __init__(self, config: LlamaConfig, tp_group=None, layer: int = 0, speed: SpeedOptions = PLAIN,
                 context: ContextParallel | None = None):
        super().__init__()
        tp_size, sp = config.tensor_model_parallel_size, config.sequence_parallel
        heads, groups = config.num_attention_heads, config.num_query_groups
        self.head_dim = config.hidden_size // heads
        self.num_heads = heads // tp_size  # local query heads
        self.heads_per_group = heads // groups
        self.split = config.kv_heads_split
        self.num_groups = groups // tp_size if self.split else groups  # key/value heads this rank computes
        self.first_head = (dist.get_rank(tp_group) if tp_size > 1 else 0) * self.num_heads  # its first query head
        self.rope_theta = config.rope_theta
        kv_size = 2 * groups * self.head_dim
        self.q = tp.ColumnParallelLinear(config.hidden_size, heads * self.head_dim, tp_group, bias=False,
                                         init_method=normal_init(config.init_method_std), sequence_parallel=sp)
        if self.split:  # [K; V] rows, stride 2: each TP rank holds the K and V rows of its groups
            self.kv = tp.ColumnParallelLinear(config.hidden_size, kv_size, tp_group, bias=False, stride=2,
                                              init_method=normal_init(config.init_method_std), sequence_parallel=sp)
        else:
            self.kv = tp.ReplicatedLinear(config.hidden_size, kv_size, tp_group, bias=False,
                                          init_method=normal_init(config.init_method_std), sequence_parallel=sp)
        self.core = AttentionCore(config.attention_dropout_rate, layer, recompute=speed.attention,  # causal, GQA
                                  context=context)
        self.proj = tp.RowParallelLinear(heads * self.head_dim, config.hidden_size, tp_group, bias=False,
                                         init_method=normal_init(config.output_init_std),
                                         sequence_parallel=sp)

    def _heads(self, t: torch.Tensor, count: int) -> torch.Tensor:
        batch, seq, _ = t.shape
        return t.view(batch, seq, count, self.head_dim).transpose(1, 2)  # [batch, heads, seq, head_dim]

    def forward(self, x: torch.Tensor, kv_cache: dict | None = None, position_ids: torch.Tensor | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        q = self._heads(self.q(x), self.num_heads)  # the full sequence under SP (gathered by the linear)
        k, v = (self._heads(t, self.num_groups) for t in self.kv(x).chunk(2, dim=2))
        past = kv_cache["k"].shape[2] if kv_cache is not None and "k" in kv_cache else 0
        positions = torch.arange(past, past + q.shape[2], device=q.device) if position_ids is None else position_ids
        q, k = rotate(q, positions, self.rope_theta), rotate(k, positions, self.rope_theta)
        if kv_cache is not None:  # generation: the cache holds this rank's key/value heads only (GQA-sized)
            if past:
                k, v = torch.cat([kv_cache["k"], k], dim=2), torch.cat([kv_cache["v"], v], dim=2)
            kv_cache["k"], kv_cache["v"] = k, v
        if not self.split:  # all groups here: one key/value head per local query head, from its group
            groups = torch.arange(self.first_head, self.first_head + self.num_heads, device=q.device)
            groups = groups // self.heads_per_group
            k, v = k.index_select(1, groups), v.index_select(1, groups)
        y = self.core(q, k, v, documents=documents).transpose(1, 2).flatten(2)
        return self.proj(y)


class SwiGLU(nn.Module):
    """hidden -> [gate; up] (one column-parallel weight, stride 2: each TP rank holds matching
    halves) -> silu(gate) * up -> hidden (row-parallel)."""

    def __init__(self, config: LlamaConfig, tp_group=None):
        super().__init__()
        sp = config.sequence_parallel
        self.fc = tp.ColumnParallelLinear(config.hidden_size, 2 * config.ffn_hidden_size, tp_group, bias=False,
                                          stride=2, init_method=normal_init(config.init_method_std),
                                          sequence_parallel=sp)
        self.proj = tp.RowParallelLinear(config.ffn_hidden_size, config.hidden_size, tp_group, bias=False,
                                         init_method=normal_init(config.output_init_std),
                                         sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-RMSNorm transformer layer: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))). Layer
    `layer` of an MoE config has a megazero.moe.MoELayer of SwiGLU experts as its mlp (Mixtral's
    shape; experts split over ep_group)."""

    def __init__(self, config: LlamaConfig, tp_group=None, layer: int = 0, ep_group=None,
                 speed: SpeedOptions = PLAIN, context: ContextParallel | None = None):
        super().__init__()
        sp, fused = config.sequence_parallel, speed.fused_kernels
        self.norm_1 = tp.RMSNorm(config.hidden_size, config.norm_epsilon, tp_group, sp, fused)
        self.attn = GroupedQueryAttention(config, tp_group, layer, speed, context)
        self.norm_2 = tp.RMSNorm(config.hidden_size, config.norm_epsilon, tp_group, sp, fused)
        moe = moe_layer_config(config, layer, "swiglu", config.output_init_std)
        if moe is None:
            self.mlp = SwiGLU(config, tp_group)
        else:  # the auxiliary losses over whole sequences under context parallelism
            self.mlp = MoELayer(moe, ep_group, tp_group, moe_stats_group(ep_group, context))
        self.dropout = config.hidden_dropout_rate
        self.sequence_parallel = sp
        self.layer = layer  # in the whole model: keys the layout-invariant dropout masks
        self.recompute = speed.layer

    def _dropout(self, x: torch.Tensor, site: int) -> torch.Tensor:
        return dropout(x, self.dropout, self.training, self.layer, site, self.sequence_parallel)

    def forward(self, x: torch.Tensor, kv_cache: dict | None = None, position_ids: torch.Tensor | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        return self.recompute(self.compute, x, kv_cache, position_ids, documents)

    def compute(self, x: torch.Tensor, kv_cache: dict | None = None, position_ids: torch.Tensor | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """The layer itself (forward adds only the recomputation)."""
        x = x + self._dropout(self.attn(self.norm_1(x), kv_cache, position_ids, documents), keyed.ATTENTION_OUTPUT)
        return x + self._dropout(self.mlp(self.norm_2(x)), keyed.MLP_OUTPUT)


class Llama(StageContract, CausalLMGeneration, nn.Module):
    """Llama language model. forward(input_ids, labels=None) -> mean cross-entropy loss or logits.

    tp_group, layers, pre_process, post_process: as GPT's (models/gpt.py). The output layer is
    `lm_head` (column-parallel over the vocabulary), or the word embedding `wte` itself when
    untie_embeddings_and_output_weights is False (then a pipelined last stage holds a tied copy).
    ep_group, speed_options: as GPT's.
    """

    example_batch = staticmethod(causal_lm_batch)  # what the measured stage split times

    def __init__(self, config: LlamaConfig, tp_group=None, layers: range | None = None, pre_process: bool = True,
                 post_process: bool = True, ep_group=None, speed_options: bool = False, cp_group=None):
        super().__init__()
        check_tp_group(config, tp_group)
        self.config = config
        self.tp_group = tp_group
        self.context = ContextParallel.of(config, cp_group)
        self.layers = layers if layers is not None else range(config.num_layers)
        self.pre_process, self.post_process = pre_process, post_process
        self.tied = not config.untie_embeddings_and_output_weights
        vocab_init = vocabulary_init(config.init_method_std, config.vocab_size)
        # one seed per layer, drawn once: every stage and shard consumes the default generator alike
        base_seed = int(torch.randint(0, 2**31 - 1, (1,), device="cpu"))
        if pre_process or (post_process and self.tied):
            with seeded(base_seed):
                self.wte = tp.VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size, tp_group,
                                                     init_method=vocab_init)
        blocks = []
        for position, i in enumerate(self.layers):
            speed = SpeedOptions.of(config, position) if speed_options else PLAIN
            with seeded(base_seed + 1 + i):
                blocks.append(Block(config, tp_group, i, ep_group, speed, self.context))
        self.blocks = nn.ModuleList(blocks)
        if post_process:
            self.norm_f = tp.RMSNorm(config.hidden_size, config.norm_epsilon, tp_group, config.sequence_parallel,
                                     fused=speed_options and config.fused_kernels)
            if not self.tied:
                with seeded(base_seed + 1 + config.num_layers):
                    self.lm_head = tp.ColumnParallelLinear(config.hidden_size, config.padded_vocab_size, tp_group,
                                                           bias=False, init_method=vocab_init,
                                                           sequence_parallel=config.sequence_parallel)

    def tied_parameters(self) -> list[nn.Parameter]:
        """The word embedding when tied to the output layer on another stage (none when untied)."""
        return super().tied_parameters() if self.tied else []

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, with dropout (split along the sequence under SP); positions are rotary."""
        if input_ids.shape[1] > self.config.seq_length:
            raise ValueError(f"sequence of {input_ids.shape[1]} tokens is longer than seq_length "
                             f"{self.config.seq_length}")
        x = self.wte(input_ids)
        if self.config.sequence_parallel:
            x = tp.scatter_to_sequence_parallel_region(x, self.tp_group)
        return dropout(x, self.config.hidden_dropout_rate, self.training, 0, keyed.EMBEDDING,
                       self.config.sequence_parallel)

    def head(self, x: torch.Tensor, labels: torch.Tensor | None, loss_mask: torch.Tensor | None = None,
             loss_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Final RMSNorm and output layer: mean loss given labels (over the tokens loss_mask keeps;
        loss_tokens: causal_lm_loss's), else the logits of the vocab_size tokens (the padding columns
        are left out of both)."""
        x = self.norm_f(x)
        if not self.tied:
            logits = self.lm_head(x)  # this TP rank's slice of the (padded) vocabulary
        else:
            if self.config.sequence_parallel:
                x = tp.gather_from_sequence_parallel_region(x, self.tp_group)
            else:
                x = tp.copy_to_tensor_parallel_region(x, self.tp_group)
            # this TP rank's slice of the (padded) vocabulary; a zero-bubble schedule may defer its weight gradient
            logits = splittable_linear(x, self.wte.weight)
        vocab = self.config.vocab_size
        if labels is None:
            return tp.gather_from_tensor_parallel_region(logits, self.tp_group)[..., :vocab]
        return causal_lm_loss(logits, labels, vocab, self.tp_group, loss_mask, loss_tokens)

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                hidden_states: torch.Tensor | None = None, kv_cache: list[dict] | None = None,
                position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Loss given labels, else logits; a stage without the head returns hidden states.
        kv_cache: one dict per layer, filled by the first call and extended by each later one
        (generation, models/generation.py: later calls pass only the new tokens). position_ids,
        document_ids, loss_mask [batch, seq]: documents packed in a sample, as GPT's."""
        if kv_cache is not None:
            past = kv_cache[0]["k"].shape[2] if "k" in kv_cache[0] else 0
            new = (input_ids if self.pre_process else hidden_states).shape[1]  # or one pipeline stage's layers
            if past + new > self.config.seq_length:
                raise ValueError(f"{past} cached + {new} new tokens exceed seq_length "
                                 f"{self.config.seq_length}")
            x = self.embed(input_ids) if self.pre_process else hidden_states
            for block, cache in zip(self.blocks, kv_cache):
                x = block(x, cache)
            return self.head(x, labels) if self.post_process else x
        loss_tokens = None
        if self.context is not None:  # this rank's chunks of the sample, at their global positions
            input_ids, labels, position_ids, loss_mask, loss_tokens = self.context.inputs(input_ids, labels,
                                                                                          position_ids, loss_mask)
        x = self.embed(input_ids) if self.pre_process else hidden_states
        documents = Documents.of(document_ids) if document_ids is not None else None
        for layer, block in zip(self.layers, self.blocks):
            layer_stream(layer)  # the layer's dropout masks, whichever stage runs it
            x = block(x, position_ids=position_ids, documents=documents)
        if not self.post_process:
            return x
        out = self.head(x, labels, loss_mask, loss_tokens)
        if labels is not None and self.training and self.config.num_experts is not None:
            # the value of the MoE layers' load-balancing and z-losses: their gradient comes through
            # the layers' outputs (megazero/moe/aux_loss.py), so that a stage without the loss trains its own too
            out = out + attached_aux_loss(self)
        return out
