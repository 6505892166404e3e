"""GPT-2: learned positions, pre-LayerNorm blocks, GELU MLP, causal SDPA attention, tied embeddings.

Plain and meant to be forked. Sizes come from GPTConfig; configs/ holds the CPU-sized default and
GPT-2 124M / 350M / 774M / 1.5B.

Model parallelism is in the layers, not in this file's logic: the linear layers are Megatron's
column/row-parallel ones and the embedding is vocab-parallel, which are plain Linear/Embedding
layers when `tp_group` is None (or has one rank). A pipeline stage is the same class built with
`layers=range(first, last)` and without the embeddings (`pre_process=False`) or the head
(`post_process=False`); models/parallelize.py decides these for each rank of the grid. Each
layer is initialised from its own seed (drawn once from the default generator), so any stage, or
any tensor-parallel shard, starts exactly as the slice of the single-process model built from the
same seed.

GPT(config) is the plain model: no recomputation, torch's kernels. GPT(config, speed_options=True),
what `parallelize(config, grid)` (models/parallelize.py) builds for the recipes, runs the config's
speed options: recompute_granularity / recompute_num_layers and fused_kernels, each layer built
with them (models.common.SpeedOptions: the MLP and the LayerNorms pick their kernels, the block
and the attention core their recomputation). Neither changes a parameter or what is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazero import tensor_parallel as tp
from megazero.moe import MoELayer, attached_aux_loss
from megazero.ops.cuda_ops import bias_gelu
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
class GPTConfig(ModelConfig):
    """Model shape. The embedding is padded to a multiple of `make_vocab_size_divisible_by` x TP
    rows; the padding is invisible (see models/common.py): logits and loss cover vocab_size only."""

    vocab_size: int = 8000  # tokens in the vocabulary (the recipes take the tokenizer's)
    seq_length: int = 256  # tokens per sample
    num_layers: int = 6  # transformer layers
    hidden_size: int = 384  # width of the residual stream
    num_attention_heads: int = 6  # attention heads (split over the tensor-parallel ranks)
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    dropout: float = 0.0  # dropout of attention probabilities and hidden states (Megatron's two: below)
    attention_dropout: float | None = None  # dropout of the attention probabilities (None: dropout)
    hidden_dropout: float | None = None  # dropout of the embeddings and each sublayer's output (None: dropout)
    init_method_std: float = 0.02  # std of the weights' normal init; output layers' std / sqrt(2 x num_layers)
    max_position_embeddings: int | None = None  # rows of the position table (None: seq_length); >= seq_length
    layernorm_epsilon: float = 1e-5  # LayerNorm's epsilon
    make_vocab_size_divisible_by: int = 128  # the embedding's rows are padded to a multiple of this x TP (Megatron's)
    # run by GPT(config, speed_options=True), what models/parallelize.py builds (see the module docstring)
    recompute_granularity: str | None = None  # "full": whole layers; "selective": the attention core
    recompute_num_layers: int | None = None  # with "full": the first N layers of each stage (default: all)
    fused_kernels: bool = True  # on GPUs, megazero's CUDA LayerNorm and bias + GeLU (where built)
    tensor_model_parallel_size: int = 1  # must equal the size of the tp_group the model is built with
    sequence_parallel: bool = False  # split LayerNorm/dropout activations along the sequence across TP ranks
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
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity must be 'full' or 'selective', got {self.recompute_granularity!r}")
        self.check_tensor_parallel()
        self.check_context_parallel()
        check_moe(self)
        tp_size = self.tensor_model_parallel_size
        if self.sequence_parallel and self.seq_length % tp_size:
            raise ValueError(f"sequence_parallel: seq_length {self.seq_length} is not divisible by "
                             f"tensor_model_parallel_size {tp_size}")


# GPT's attention core: the models' one (models/common.py), causal
CausalAttention = AttentionCore


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask; this TP rank computes its share of the heads."""

    def __init__(self, config: GPTConfig, tp_group=None, layer: int = 0, speed: SpeedOptions = PLAIN,
                 context: ContextParallel | None = None):
        super().__init__()
        self.num_heads = config.num_attention_heads // config.tensor_model_parallel_size  # local heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        sp = config.sequence_parallel
        residual_std = config.output_init_std
        # fused [Q; K; V] rows, stride 3: each TP rank holds the Q, K and V rows of its heads
        self.qkv = tp.ColumnParallelLinear(config.hidden_size, 3 * config.hidden_size, tp_group,
                                           init_method=normal_init(config.init_method_std), stride=3,
                                           sequence_parallel=sp)
        self.core = CausalAttention(config.attention_dropout_rate, layer, recompute=speed.attention, context=context)
        self.proj = tp.RowParallelLinear(config.hidden_size, config.hidden_size, tp_group,
                                         init_method=normal_init(residual_std), sequence_parallel=sp)

    def forward(self, x: torch.Tensor, kv_cache: dict | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        qkv = self.qkv(x)  # [batch, seq, 3 * local heads * head_dim] (the full sequence under SP)
        batch, seq, _ = qkv.shape
        q, k, v = (t.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
        if kv_cache is not None:  # generation: attend to the cached keys/values too, then cache these
            if "k" in kv_cache:
                k, v = torch.cat([kv_cache["k"], k], dim=2), torch.cat([kv_cache["v"], v], dim=2)
            kv_cache["k"], kv_cache["v"] = k, v
        y = self.core(q, k, v, documents=documents)
        y = y.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return self.proj(y)


class MLP(nn.Module):
    """hidden -> ffn (column-parallel) -> GELU -> hidden (row-parallel). fused: on CUDA inputs,
    bias + GeLU in megazero's fused kernel (cuda_ops.bias_gelu: torch's ops where the kernel is
    not built or does not take the input); an edit to the GeLU below must change that line too, or
    run with `fused_kernels: false`."""

    def __init__(self, config: GPTConfig, tp_group=None, fused: bool = False):
        super().__init__()
        self.fused = fused
        sp = config.sequence_parallel
        residual_std = config.output_init_std
        self.fc = tp.ColumnParallelLinear(config.hidden_size, config.ffn_hidden_size, tp_group,
                                          init_method=normal_init(config.init_method_std), sequence_parallel=sp)
        self.proj = tp.RowParallelLinear(config.ffn_hidden_size, config.hidden_size, tp_group,
                                         init_method=normal_init(residual_std), sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.is_cuda:
            return self.proj(bias_gelu(self.fc(x, add_bias=False), self.fc.bias))
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm transformer layer: x + drop(attn(ln(x))), then x + drop(mlp(ln(x))). Layer
    `layer` of an MoE config has a megazero.moe.MoELayer of GeLU experts as its mlp (experts split
    over ep_group)."""

    def __init__(self, config: GPTConfig, tp_group=None, layer: int = 0, ep_group=None,
                 speed: SpeedOptions = PLAIN, context: ContextParallel | None = None):
        super().__init__()
        sp, fused = config.sequence_parallel, speed.fused_kernels
        self.ln_1 = tp.LayerNorm(config.hidden_size, config.layernorm_epsilon, tp_group, sp, fused)
        self.attn = CausalSelfAttention(config, tp_group, layer, speed, context)
        self.ln_2 = tp.LayerNorm(config.hidden_size, config.layernorm_epsilon, tp_group, sp, fused)
        moe = moe_layer_config(config, layer, "gelu", config.output_init_std)
        if moe is None:
            self.mlp = MLP(config, tp_group, fused)
        else:  # the auxiliary losses over whole sequences under context parallelism
            self.mlp = MoELayer(moe, ep_group, tp_group, moe_stats_group(ep_group, context))
        self.dropout = config.hidden_dropout_rate
        self.sequence_parallel = sp
        self.layer = layer  # in the whole model: keys the layout-invariant dropout masks
        self.recompute = speed.layer

    def _dropout(self, x: torch.Tensor, site: int) -> torch.Tensor:
        return dropout(x, self.dropout, self.training, self.layer, site, self.sequence_parallel)

    def forward(self, x: torch.Tensor, kv_cache: dict | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        return self.recompute(self.compute, x, kv_cache, documents)

    def compute(self, x: torch.Tensor, kv_cache: dict | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """The layer itself (forward adds only the recomputation)."""
        x = x + self._dropout(self.attn(self.ln_1(x), kv_cache, documents), keyed.ATTENTION_OUTPUT)
        return x + self._dropout(self.mlp(self.ln_2(x)), keyed.MLP_OUTPUT)


class GPT(StageContract, CausalLMGeneration, nn.Module):
    """GPT-2 language model. forward(input_ids, labels=None) -> mean cross-entropy loss or logits.

    tp_group: tensor-parallel process group (None: one rank). layers / pre_process / post_process:
    build one pipeline stage (which of the config's layers; with the embeddings; with the final
    LayerNorm, head and loss). A stage without pre_process takes `hidden_states` instead of ids;
    one without post_process returns its hidden states. speed_options: run the config's
    recomputation and fused kernels (False: the plain model). generate(): models/generation.py.
    ep_group: the expert-parallel group of the MoE layers (config.num_experts; None: all experts
    here). In training, the loss includes the MoE layers' auxiliary losses (the value; every stage's
    layers get their gradient through their outputs, megazero/moe/aux_loss.py).
    """

    example_batch = staticmethod(causal_lm_batch)  # what the measured stage split times

    def __init__(self, config: GPTConfig, tp_group=None, layers: range | None = None, pre_process: bool = True,
                 post_process: bool = True, ep_group=None, speed_options: bool = False, cp_group=None):
        super().__init__()
        check_tp_group(config, tp_group)
        self.config = config
        self.tp_group = tp_group
        self.context = ContextParallel.of(config, cp_group)
        self.layers = layers if layers is not None else range(config.num_layers)
        self.pre_process, self.post_process = pre_process, post_process
        # one seed per layer, drawn once: every stage and shard consumes the default generator alike
        base_seed = int(torch.randint(0, 2**31 - 1, (1,), device="cpu"))
        with seeded(base_seed):
            # the output layer is tied to the word embedding: the last stage holds a copy (kept equal
            # by summing both copies' gradients, see tied_parameters) built from the same seed as the
            # first stage's
            if pre_process or post_process:
                vocab_init = vocabulary_init(config.init_method_std, config.vocab_size)
                self.wte = tp.VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size, tp_group,
                                                     init_method=vocab_init)
            if pre_process:
                self.wpe = nn.Embedding(config.max_position_embeddings or config.seq_length, config.hidden_size)
                nn.init.normal_(self.wpe.weight, mean=0.0, std=config.init_method_std)
        blocks = []
        for position, i in enumerate(self.layers):
            speed = SpeedOptions.of(config, position) if speed_options else PLAIN
            with seeded(base_seed + 1 + i):
                blocks.append(Block(config, tp_group, i, ep_group, speed, self.context))
        self.blocks = nn.ModuleList(blocks)
        if post_process:
            self.ln_f = tp.LayerNorm(config.hidden_size, config.layernorm_epsilon, tp_group, config.sequence_parallel,
                                     fused=speed_options and config.fused_kernels)

    def embed(self, input_ids: torch.Tensor, first_position: int = 0,
              position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token + position embeddings (positions from first_position on, or position_ids [batch,
        seq]), with dropout (split along the sequence under SP)."""
        end = first_position + input_ids.shape[1]
        if end > self.config.seq_length:
            raise ValueError(f"sequence of {end} tokens is longer than seq_length {self.config.seq_length}")
        if position_ids is None:
            position_ids = torch.arange(first_position, end, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(position_ids)
        if self.config.sequence_parallel:
            x = tp.scatter_to_sequence_parallel_region(x, self.tp_group)
        return dropout(x, self.config.hidden_dropout_rate, self.training, 0, keyed.EMBEDDING,
                       self.config.sequence_parallel)

    def head(self, x: torch.Tensor, labels: torch.Tensor | None, loss_mask: torch.Tensor | None = None,
             loss_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Final LayerNorm and tied output layer: mean loss given labels (over the tokens loss_mask
        keeps; loss_tokens: causal_lm_loss's), else the logits of the vocab_size tokens (the padding
        columns are left out of both)."""
        x = self.ln_f(x)
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
        (generation: later calls pass only the new tokens). position_ids, document_ids, loss_mask
        [batch, seq]: documents packed in a sample (megazero/data/packing.py): positions, attention
        within each document, the tokens the loss counts."""
        if kv_cache is not None:  # also one pipeline stage's layers (megazero.pipeline.generation)
            past = kv_cache[0]["k"].shape[2] if "k" in kv_cache[0] else 0
            x = self.embed(input_ids, past) if self.pre_process else hidden_states
            for block, cache in zip(self.blocks, kv_cache):
                x = block(x, cache)
            return self.head(x, labels) if self.post_process else x
        loss_tokens = None
        if self.context is not None:  # this rank's chunks of the sample, at their global positions
            input_ids, labels, position_ids, loss_mask, loss_tokens = self.context.inputs(input_ids, labels,
                                                                                          position_ids, loss_mask)
        x = self.embed(input_ids, position_ids=position_ids) if self.pre_process else hidden_states
        documents = Documents.of(document_ids) if document_ids is not None else None
        for layer, block in zip(self.layers, self.blocks):
            layer_stream(layer)  # the layer's dropout masks, whichever stage runs it
            x = block(x, documents=documents)
        if not self.post_process:
            return x
        out = self.head(x, labels, loss_mask, loss_tokens)
        if labels is not None and self.training and self.config.num_experts is not None:
            # the value of the MoE layers' load-balancing and z-losses: their gradient comes through
            # the layers' outputs (megazero/moe/aux_loss.py), so that a stage without the loss trains its own too
            out = out + attached_aux_loss(self)
        return out
