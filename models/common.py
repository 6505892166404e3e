"""What models/gpt.py, models/llama.py and models/bert.py share: config loading and vocabulary
padding, the model contract the engine and checkpoints ask through (megazero.model_contract), the
per-layer seeding that makes every shard and stage start as the single-process model, the
initialisers, and the pieces every model runs: the attention core (`AttentionCore`), dropout
(`dropout`) and the speed options a layer is built with (`SpeedOptions`: fused kernels,
recomputation). Edit the attention here and all three models, in every dropout mode, run it.

Vocabulary padding is an implementation detail of the layout: the embedding gets rows up to a
multiple of make_vocab_size_divisible_by x TP so that it splits evenly over the tensor-parallel
ranks, but the padding rows are never looked up (ids are below vocab_size), their logits are
left out of the loss and out of the logits the models return, so they get zero gradient and
their values never matter. They start as zeros (`vocabulary_init`), and a checkpoint moved to a
layout that pads differently adds or drops padding rows only, without changing the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megazero.activation_checkpointing import checkpoint
from megazero.context_parallel import (
    Visible,
    load_balanced_positions,
    ring_attention,
    split_sequence,
    ulysses_attention,
)
from megazero.meta_device import skeleton
from megazero.moe.router import SCORE_ORDERS
from megazero.tensor_parallel import invariant_dropout as keyed
from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megazero.tensor_parallel.random import get_rng_tracker, layout_invariant_keys


class ModelConfig:
    """Mixin for the models' config dataclasses (fields vocab_size, make_vocab_size_divisible_by,
    tensor_model_parallel_size, num_attention_heads, ffn_hidden_size)."""

    def check_tensor_parallel(self) -> None:
        """Heads and the MLP width must split evenly over the tensor-parallel ranks."""
        for name in ("num_attention_heads", "ffn_hidden_size"):
            if getattr(self, name) % self.tensor_model_parallel_size:
                raise ValueError(f"{name} {getattr(self, name)} is not divisible by tensor_model_parallel_size "
                                 f"{self.tensor_model_parallel_size}")

    def check_context_parallel(self) -> None:
        """Context parallelism's needs: 2 x CP chunks of the sequence (each split over TP under SP)
        and a known attention path."""
        cp = getattr(self, "context_parallel_size", 1)
        if cp == 1:
            return
        chunks = 2 * cp * (self.tensor_model_parallel_size if self.sequence_parallel else 1)
        if self.seq_length % chunks:
            under_sp = ", each split over TP under sequence_parallel" if chunks > 2 * cp else ""
            raise ValueError(f"context_parallel_size {cp}: seq_length {self.seq_length} must be divisible by {chunks} "
                             f"(2 x CP chunks{under_sp})")
        if self.cp_comm_type not in ("p2p", "a2a"):
            raise ValueError(f"cp_comm_type must be 'p2p' (ring attention) or 'a2a' (all-to-all), got "
                             f"{self.cp_comm_type!r}")


    def check_positions(self) -> None:
        """Megatron's max_position_embeddings, where given, must cover seq_length."""
        if self.max_position_embeddings is not None and self.max_position_embeddings < self.seq_length:
            raise ValueError(f"max_position_embeddings {self.max_position_embeddings} is less than seq_length "
                             f"{self.seq_length}")

    @property
    def attention_dropout_rate(self) -> float:
        """Megatron's --attention-dropout, else the model's dropout."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def hidden_dropout_rate(self) -> float:
        """Megatron's --hidden-dropout, else the model's dropout."""
        return self.dropout if self.hidden_dropout is None else self.hidden_dropout

    @property
    def output_init_std(self) -> float:
        """The std of the layers writing into the residual stream (GPT-2's and Megatron's scaled init)."""
        return self.init_method_std / math.sqrt(2 * self.num_layers)

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up to a multiple of make_vocab_size_divisible_by x TP (Megatron's padding):
        the rows of the embedding; only the first vocab_size are tokens."""
        m = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return ((self.vocab_size + m - 1) // m) * m

    def single_process(self):
        """The same model in one process (TP = 1, its padding): the size the recipes report, the same
        at every layout (whole() keeps this layout's padded vocabulary instead)."""
        return dataclasses.replace(self, **self._one_process({"tensor_model_parallel_size": 1}))

    def _one_process(self, changes: dict) -> dict:
        """`changes` plus the layout fields this config has, set for one process (no SP, CP 1)."""
        if hasattr(self, "sequence_parallel"):
            changes["sequence_parallel"] = False
        if hasattr(self, "context_parallel_size"):
            changes["context_parallel_size"] = 1
        return changes

    def whole(self):
        """The same model at TP = 1 with the same (padded) vocabulary: the shape of the whole tensors."""
        return dataclasses.replace(self, **self._one_process({
            "tensor_model_parallel_size": 1,
            "make_vocab_size_divisible_by": self.make_vocab_size_divisible_by * self.tensor_model_parallel_size}))

    @classmethod
    def from_json(cls, path: str, **overrides):
        """Read a model config JSON (keys as the fields), with overrides for non-None values."""
        with open(path) as f:
            values = json.load(f)
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{path}: unknown model config keys {sorted(unknown)}")
        return cls(**{**values, **{k: v for k, v in overrides.items() if v is not None}})

    def to_dict(self) -> dict:
        """Plain dict of the fields (for checkpoints and logs)."""
        return dataclasses.asdict(self)


class StageContract:
    """megazero.model_contract.ModelContract for a model built as one pipeline stage: its layers
    `self.blocks` are the config's layers `self.layers`, the first stage (`pre_process`) holds
    the word embedding `self.wte` and the last (`post_process`) the output layer tied to it."""

    def global_parameter_name(self, name: str) -> str:
        """`name` with this stage's layer numbers made global (blocks.0 of stage 2 -> blocks.{first})."""
        if name.startswith("blocks."):
            index, rest = name[len("blocks."):].split(".", 1)
            return f"blocks.{self.layers[int(index)]}.{rest}"
        return name

    def tied_parameters(self) -> list[nn.Parameter]:
        """The word embedding when it is tied to an output layer on another stage (pipelined): the
        two copies' gradients are summed."""
        return [self.wte.weight] if self.pre_process != self.post_process else []

    def num_parameters(self) -> int:
        """Trainable parameters on this rank (a tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def total_parameters(self) -> int:
        """Parameters of the whole model, all shards and stages (see count_parameters)."""
        return count_parameters(type(self), self.config)


def check_moe(config: ModelConfig) -> None:
    """The mixture-of-experts fields (GPT's and Llama's num_experts, moe_*) must make sense together."""
    if config.num_experts is None:
        return
    if config.num_experts < 1 or config.moe_router_topk not in (1, 2) or config.moe_router_topk > config.num_experts:
        raise ValueError(f"num_experts {config.num_experts} needs moe_router_topk 1 or 2 (at most num_experts), "
                         f"got {config.moe_router_topk}")
    if config.moe_router_score_order not in SCORE_ORDERS:
        raise ValueError(f"moe_router_score_order must be one of {SCORE_ORDERS}, got {config.moe_router_score_order!r}")
    if config.moe_layer_freq < 1:
        raise ValueError(f"moe_layer_freq must be at least 1, got {config.moe_layer_freq}")


def moe_stats_group(ep_group, context: ContextParallel | None):
    """The group whose tokens an MoE layer's auxiliary losses cover (MoELayer's stats_group): the
    EP group's; under context parallelism whole sequences', so that the losses are the single
    process's: the CP group, or the EP group where it holds whole CP groups (the grid makes one
    size divide the other)."""
    if context is None:
        return ep_group
    ep = dist.get_world_size(ep_group) if ep_group is not None else 1
    return ep_group if ep % dist.get_world_size(context.group) == 0 else context.group


def moe_layer_config(config: ModelConfig, layer: int, activation: str, output_init_std: float):
    """The megazero.moe.MoEConfig of layer `layer` (0-based), or None where that layer keeps its dense
    MLP: no experts configured, or layer % moe_layer_freq != 0 (Megatron's --moe-layer-freq)."""
    if config.num_experts is None or layer % config.moe_layer_freq:
        return None
    from megazero.moe import MoEConfig

    return MoEConfig(hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
                     num_experts=config.num_experts, router_topk=config.moe_router_topk,
                     capacity_factor=config.moe_capacity_factor, aux_loss_coeff=config.moe_aux_loss_coeff,
                     z_loss_coeff=config.moe_z_loss_coeff, score_order=config.moe_router_score_order,
                     activation=activation, output_init_std=output_init_std,
                     attach_aux_loss=True,  # their gradient through the layer's output, on any pipeline stage
                     sequence_parallel=config.sequence_parallel)  # gathers the sequence, returns this rank's slice


def normal_init(std: float):
    """Initialiser drawing N(0, std) (GPT-2 and BERT use 0.02)."""
    return lambda tensor: nn.init.normal_(tensor, mean=0.0, std=std)


def vocabulary_init(std: float, vocab_size: int):
    """Initialiser of a padded [rows, hidden] vocabulary: N(0, std) for the first vocab_size rows,
    zeros for the padding. It draws exactly what a [vocab_size, hidden] tensor would, whatever the
    padding, so the embedding (and everything seeded after it) starts the same at every TP size."""

    def init(tensor: torch.Tensor) -> None:
        nn.init.normal_(tensor[:vocab_size], mean=0.0, std=std)
        nn.init.zeros_(tensor[vocab_size:])

    return init


def check_tp_group(config: ModelConfig, tp_group) -> None:
    """The tp_group a model is built with must have config.tensor_model_parallel_size ranks."""
    size = tp_group.size() if tp_group is not None else 1
    if size != config.tensor_model_parallel_size:
        raise ValueError(f"{type(config).__name__}.tensor_model_parallel_size is {config.tensor_model_parallel_size} "
                         f"but the tp_group has {size} ranks")


@contextlib.contextmanager
def seeded(seed: int):
    """Run the block with the default CPU generator seeded to `seed`, restoring it afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def causal_lm_batch(config: ModelConfig, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """A micro-batch of `micro_batch_size` random sequences of seq_length tokens with next-token
    labels, for a causal language model (GPT's and Llama's example_batch: the measured stage split
    times the stages on it); its own generator, so drawing it moves no other."""
    ids = torch.randint(0, config.vocab_size, (micro_batch_size, config.seq_length), generator=torch.Generator())
    return {"input_ids": ids, "labels": ids.roll(-1, dims=1)}


def count_parameters(model_class, config: ModelConfig) -> int:
    """Parameters of the whole model (all stages and shards; a tied embedding once), counted on the
    meta device without allocating anything, and without consuming random numbers (building a
    model draws its layers' base seed; a count after a checkpoint's RNG states were restored
    must not move them)."""
    with skeleton():
        return model_class(config.whole()).num_parameters()


def count_active_parameters(model_class, config: ModelConfig) -> int:
    """Parameters one token passes through, for FLOPs and MFU: count_parameters with each MoE
    layer's experts counted moe_router_topk / num_experts times (a token visits topk of them; the
    routers and every dense layer count whole). A dense model's is its count_parameters."""
    with skeleton():
        model = model_class(config.whole())
        total = model.num_parameters()
        if getattr(config, "num_experts", None) is None:
            return total
        experts = sum(p.numel() for p in model.parameters() if getattr(p, "megazero_expert", False))
        return total - experts + experts * config.moe_router_topk // config.num_experts


def dropout(x: torch.Tensor, p: float, training: bool, layer: int = 0, site: int = keyed.EMBEDDING,
            sequence_parallel: bool = False) -> torch.Tensor:
    """Dropout of hidden states at dropout site `site` (keyed.EMBEDDING, ATTENTION_OUTPUT,
    MLP_OUTPUT) of layer `layer` of the whole model (the embedding's is layer 0's EMBEDDING).
    Default mode: F.dropout on the layer's stream, per TP rank where sequence parallelism gives
    each rank other tokens; layout-invariant mode: the engine's per-sample masks keyed by (layer,
    site) (megazero/tensor_parallel/invariant_dropout.py)."""
    if not (training and p):
        return x
    if keyed.layout_invariant():
        return keyed.hidden_dropout(x, p, layer, site, sequence_parallel)
    with get_rng_tracker().fork() if sequence_parallel else contextlib.nullcontext():
        return F.dropout(x, p, True)


@dataclasses.dataclass(frozen=True)
class Recompute:
    """Whether a module's forward is recomputed in backward instead of keeping its activations,
    while gradients are on (megazero.activation_checkpointing.checkpoint: the forward's RNG states
    are restored, so dropout masks and gradients are exactly those without recomputation). The
    module calls `self.recompute(self.compute, *args)` in its forward: no wrapper module, so
    parameter names and the state dict stay the plain model's.

    kept: how many leading arguments the checkpoint keeps (the others, an attention mask or a KV
    cache, are closed over); partitionable: the kept inputs are the same on every tensor-parallel
    rank, so partition_activations may split them."""

    enabled: bool = False
    kept: int = 1
    partitionable: bool = False

    def __call__(self, function, *args):
        """function(*args), recomputed in backward where enabled and gradients are on."""
        if not (self.enabled and torch.is_grad_enabled()):
            return function(*args)
        kept, rest = args[:self.kept], args[self.kept:]
        return checkpoint(lambda *kept: function(*kept, *rest), *kept, partitionable=self.partitionable)


@dataclasses.dataclass(frozen=True)
class SpeedOptions:
    """How one layer runs, never what it computes nor its parameters: fused_kernels (megazero's
    fused norms and bias + GeLU where they are built and take the input), `layer` (the whole layer
    recomputed: recompute_granularity "full") and `attention` (its attention core recomputed:
    "selective"). SpeedOptions() is the plain layer."""

    fused_kernels: bool = False
    layer: Recompute = Recompute()
    attention: Recompute = Recompute(kept=3)

    @classmethod
    def of(cls, config: ModelConfig, position: int) -> SpeedOptions:
        """The config's options for the layer at `position` in its stage (0: the stage's first):
        fused_kernels (a config without the field: none); recompute_granularity "full" recomputes
        the first recompute_num_layers layers of each stage (all by default, as Megatron), keeping
        their input (the same on every TP rank unless sequence parallelism splits it);
        "selective" every attention core, keeping q, k and v (this rank's heads: never
        partitionable)."""
        granularity, count = config.recompute_granularity, config.recompute_num_layers
        full = granularity == "full" and (count is None or position < count)
        return cls(fused_kernels=getattr(config, "fused_kernels", False),
                   layer=Recompute(full, kept=1, partitionable=not config.sequence_parallel),
                   attention=Recompute(granularity == "selective", kept=3))


PLAIN = SpeedOptions()  # the plain layer: torch's kernels, nothing recomputed


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d) [masked]) v with dropout on the probabilities: the attention of
    GPT, Llama and BERT, without parameters (its own module so that selective recomputation can
    recompute it alone). q: [batch, heads, seq_q, d]; k, v: [batch, key/value heads, seq_k, d],
    each key/value head serving consecutive query heads (grouped-query attention).

    causal: query i sees the keys before it (and the cached ones, generation); otherwise
    forward's `attend` (bool, True: attend) says what each query sees. `layer` (in the whole
    model) keys the masks in the layout-invariant dropout mode, which supplies them here: the
    math is then written out (torch's fused kernel draws its own random numbers)."""

    def __init__(self, dropout: float, layer: int = 0, causal: bool = True,
                 recompute: Recompute = PLAIN.attention, context: ContextParallel | None = None):
        super().__init__()
        self.dropout = dropout
        self.layer = layer
        self.causal = causal
        self.recompute = recompute
        self.context = context

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attend: torch.Tensor | None = None, documents: Documents | None = None) -> torch.Tensor:
        return self.recompute(self.compute, q, k, v, attend, documents)

    def compute(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attend: torch.Tensor | None = None, documents: Documents | None = None) -> torch.Tensor:
        """The attention itself (forward adds only the recomputation). `documents` (causal only):
        each query sees the keys before it in its own document."""
        p = self.dropout if self.training else 0.0
        if self.context is not None:  # this rank's chunks of the sequence, attending over every rank's
            return self.context.attention(q, k, v, self.causal, p, self.layer, attend, documents)
        mask, is_causal = attend, False
        if self.causal and documents is None:
            if attend is not None:
                raise ValueError("a causal AttentionCore makes its own mask: pass `attend` to one built causal=False")
            past = k.shape[2] - q.shape[2]  # keys cached from earlier steps (generation)
            if past and q.shape[2] > 1:  # query i sees the cache and the first i + 1 new keys
                mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(diagonal=past)
            is_causal = past == 0
        dropout_mask = keyed.attention_dropout_mask(q, k.shape[2], p, self.layer) if p and keyed.layout_invariant() \
            else None  # the engine's masks, one per (sample, global head)
        return whole_attention(q, k, v, p, dropout_mask, mask, is_causal, documents)


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """This rank's place in a context-parallel group (megazero/context_parallel/): the model takes
    its chunks of each sample (`split`) at their global positions (`positions`), and the attention
    core attends over every rank's chunks by `comm_type` ("p2p": ring, "a2a": all-to-all)."""

    group: object
    comm_type: str = "p2p"

    @classmethod
    def of(cls, config: ModelConfig, cp_group) -> ContextParallel | None:
        """The context of a model built with cp_group (None at CP 1 or without a group)."""
        if cp_group is None or getattr(config, "context_parallel_size", 1) == 1:
            return None
        if dist.get_world_size(cp_group) != config.context_parallel_size:
            raise ValueError(f"context_parallel_size is {config.context_parallel_size} but the cp_group has "
                             f"{dist.get_world_size(cp_group)} ranks")
        return cls(cp_group, config.cp_comm_type)

    def inputs(self, input_ids, labels, position_ids, loss_mask) -> tuple:
        """(input_ids, labels, position_ids, loss_mask, loss_tokens) of this rank's tokens from a
        whole-sample batch (every pipeline stage gets the batch: the ids give the sequence length).
        Positions are the global ones unless position_ids (packed documents') are given. The loss
        is this rank's masked sum over loss_tokens, the whole sequence's masked tokens / CP: the
        mean over the CP ranks (the gradients' and the logged loss's) is the whole sequence's loss
        (None without a loss_mask: every rank has as many tokens)."""
        if position_ids is None:
            position_ids = self.positions(input_ids.shape[1], input_ids.device)
        else:
            position_ids = self.split(position_ids)
        if loss_mask is None:
            return self.split(input_ids), self.split_or_none(labels), position_ids, None, None
        return self.split(input_ids), self.split_or_none(labels), position_ids, self.split(loss_mask), \
            self.loss_tokens(loss_mask)

    def loss_tokens(self, loss_mask: torch.Tensor) -> torch.Tensor:
        """What this rank divides its masked loss sum by: the whole batch's masked tokens / CP
        (at least 1 / CP: a batch without masked tokens has loss 0, as at CP 1)."""
        return loss_mask.float().sum().clamp(min=1.0) / dist.get_world_size(self.group)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a whole-sequence [batch, seq, ...] tensor."""
        return split_sequence(x, dist.get_world_size(self.group), dist.get_rank(self.group), dim=1)

    def split_or_none(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """split(x), None for None."""
        return None if x is None else self.split(x)

    def positions(self, seq_length: int, device) -> torch.Tensor:
        """The global positions of this rank's tokens of a seq_length sequence."""
        return load_balanced_positions(seq_length, dist.get_world_size(self.group), dist.get_rank(self.group), device)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dropout_p: float = 0.0,
                  layer: int = 0, attend: torch.Tensor | None = None,
                  documents: Documents | None = None) -> torch.Tensor:
        """Attention of this rank's queries over the whole sequence's keys and values, with dropout
        `dropout_p` on the probabilities: the layout-invariant mode's masks (the whole sequence's,
        keyed by global head), or for all-to-all torch's own draw (ring attention takes only the
        layout-invariant masks: an error otherwise). attend: [batch, 1, 1, seq] the whole
        sequence's keys each query sees (BERT's padding); documents: the whole sequence's packed
        documents (causal within each)."""
        cp_size, cp_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        keyed_masks = bool(dropout_p) and keyed.layout_invariant()
        first_head = layout_invariant_keys().tp_rank * q.shape[1] if keyed_masks else 0
        seq = q.shape[2] * cp_size
        if attend is not None and tuple(attend.shape[1:3]) != (1, 1):
            raise ValueError(f"context parallelism takes a key mask [batch, 1, 1, seq] as `attend`, got "
                             f"{tuple(attend.shape)}")
        if self.comm_type == "p2p":
            if dropout_p and not keyed_masks:
                raise ValueError("ring attention (cp_comm_type p2p) with attention dropout needs the layout-invariant "
                                 "masks (engine config dropout_masks.layout_invariant); or use cp_comm_type a2a, or "
                                 "attention_dropout 0")
            mask = keyed.whole_attention_dropout_mask(q, seq, dropout_p, layer, first_head) if keyed_masks else None
            visible = Visible(None if attend is None else attend[:, 0, 0],
                              None if documents is None else documents.ids)
            return ring_attention(q, k, v, self.group, causal, mask, visible)

        def attend_heads(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:  # this rank's head group
            mask = (keyed.whole_attention_dropout_mask(a, seq, dropout_p, layer, first_head + cp_rank * a.shape[1])
                    if keyed_masks else None)
            return whole_attention(a, b, c, dropout_p, mask, attend, causal, documents)

        return ulysses_attention(q, k, v, self.group, attend_heads)


def whole_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, dropout_mask: torch.Tensor | None,
                    attend: torch.Tensor | None, is_causal: bool, documents: Documents | None) -> torch.Tensor:
    """Attention of q over all of k and v: within each of `documents` where given, else with the
    bool mask `attend` and/or the causal mask; dropout p on the probabilities by `dropout_mask`
    (the layout-invariant mode's: the math written out) or by torch's draw (the fused kernel)."""
    if documents is not None:
        if dropout_mask is not None:  # the math written out anyway: the mask costs nothing more
            return keyed.softmax_attention(q, k, v, documents.mask(q.device), False, dropout_mask)
        with get_rng_tracker().fork():
            return documents.attention(q, k, v, p)
    if dropout_mask is not None:
        return keyed.softmax_attention(q, k, v, attend, is_causal, dropout_mask)
    with get_rng_tracker().fork():  # attention dropout differs between the TP ranks' heads
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attend, is_causal=is_causal, dropout_p=p,
                                              enable_gqa=q.shape[1] != k.shape[1])


@dataclasses.dataclass(frozen=True)
class Documents:
    """The documents packed in each sample of a batch (Megatron's --reset-attention-mask):
    `spans[b]` lists sample b's documents as [start, end) positions. Attention runs per document,
    each one torch's causal kernel on its own slice, so no [seq, seq] mask is built. `ids` is
    the document_ids they were read from (what ring attention builds its block masks from)."""

    spans: tuple[tuple[tuple[int, int], ...], ...]
    seq_length: int
    ids: torch.Tensor = dataclasses.field(compare=False, repr=False)

    @classmethod
    def of(cls, document_ids: torch.Tensor) -> Documents:
        """From document_ids [batch, seq] (non-decreasing along each sample: megazero/data/packing.py)."""
        spans = []
        for row in document_ids:
            _, counts = torch.unique_consecutive(row, return_counts=True)
            ends = counts.cumsum(0).tolist()
            spans.append(tuple(zip([0] + ends[:-1], ends)))
        return cls(tuple(spans), document_ids.shape[1], document_ids)

    def mask(self, device: torch.device) -> torch.Tensor:
        """[batch, 1, seq, seq] bool, True where a query sees a key: causal within each document
        (for the written-out attention of the layout-invariant dropout mode)."""
        mask = torch.zeros(len(self.spans), 1, self.seq_length, self.seq_length, dtype=torch.bool, device=device)
        for b, spans in enumerate(self.spans):
            for start, end in spans:
                mask[b, 0, start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool,
                                                              device=device).tril()
        return mask

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """Causal attention of each document alone ([batch, heads, seq, d] in and out)."""
        gqa = q.shape[1] != k.shape[1]
        rows = [torch.cat([F.scaled_dot_product_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e],
                                                          is_causal=True, dropout_p=dropout_p, enable_gqa=gqa)
                           for s, e in spans], dim=2)
                for b, spans in enumerate(self.spans)]
        return torch.cat(rows, dim=0)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, tp_group,
                   loss_mask: torch.Tensor | None = None, loss_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of this TP rank's vocabulary slice of the logits (the whole vocabulary
    without tensor parallelism; padding columns left out), over the tokens `loss_mask` keeps
    (Megatron's --eod-mask-loss: sum(loss x mask) / sum(mask); None: every token). loss_tokens:
    what the masked sum is divided by instead of sum(mask) (context parallelism's share,
    ContextParallel.loss_tokens)."""
    reduction = "mean" if loss_mask is None else "none"
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        losses = F.cross_entropy(logits[..., :vocab_size].float().reshape(-1, vocab_size), labels.reshape(-1),
                                 reduction=reduction)
    else:
        losses = vocab_parallel_cross_entropy(logits, labels, tp_group, vocab_size=vocab_size)
        losses = losses.mean() if loss_mask is None else losses.reshape(-1)
    if loss_mask is None:
        return losses
    mask = loss_mask.reshape(-1).float()
    return (losses * mask).sum() / (mask.sum().clamp(min=1.0) if loss_tokens is None else loss_tokens)
