"""This rank's module for a model config and the parallel grid: the one place where the parallel
layout shapes a model (in the manner of torchtitan's `parallelize_llama`).

    model = parallelize(GPTConfig(...), grid)   # grid from megazero.parallel_state; None: one process

What it decides, for this rank of the grid:
- tensor / sequence parallelism: the model is built over the grid's tensor-parallel group, so its
  column/row-parallel linears, vocab-parallel embedding and LayerNorms hold this rank's shard
  (and split activations along the sequence where config.sequence_parallel is set); the config's
  tensor_model_parallel_size must be the grid's;
- expert parallelism: a config with num_experts gets the grid's expert-parallel group, over which
  its MoE layers split their experts (megazero/moe/);
- the pipeline stage: which of the config's layers this stage holds (`stage_layers`: contiguous
  ranges balanced by parameter count, or with partition_method "compute" by forward FLOPs: the
  last stage's output layer and loss over the vocabulary weigh what they cost, or with "measured"
  by the time each piece takes here, timed at build time), whether it embeds
  (first stage) and holds the head and loss (last stage), and so whether its word embedding is
  tied to a copy on another stage;
- recomputation (`apply_recompute`): config.recompute_granularity "full" recomputes whole layers
  (the first recompute_num_layers of the stage, default all) in backward, "selective" only the
  attention core;
- fused kernels (`apply_fused_kernels`, GPT's config.fused_kernels): megazero's CUDA LayerNorm and
  bias + GeLU in the MLP, on GPUs, where built; Llama's config.fused_kernels: megazero's fused
  RMSNorm (CUDA kernel on GPUs, C++ op on CPUs, where built).

The models themselves (models/gpt.py, models/bert.py) are plain: they take the stage and the
tp_group as constructor arguments, know nothing of the grid, and GPT(config) / Bert(config)
recompute nothing and run torch's kernels. Recomputation and fused kernels change how a module
runs, never its parameters: their names, the state dict and the model contract stay those of the
plain model; the engine and checkpoints ask them only through the model contract
(megazero.model_contract, models/README.md). A new model gets one line in MODELS and a stage
weight function in _STAGE_WEIGHTS.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megazero import tensor_parallel as tp
from megazero.activation_checkpointing import checkpoint
from megazero.ops.cuda_ops import bias_gelu
from megazero.parallel_state import ParallelGrid
from megazero.pipeline.chunks import ModelChunks, chunk_count, chunk_stage
from megazero.pipeline.partition import (
    PARTITION_METHODS,
    balanced_stage_layers,
    head_forward_flops,
    layer_forward_flops,
    simulated_interleaved_layers,
)
from megazero.pipeline.stage_timing import measure_stage_weights
from models.bert import Bert, BertConfig
from models.common import ModelConfig
from models.gpt import GPT, MLP, GPTConfig
from models.llama import Llama, LlamaConfig

MODELS: dict[type, type[torch.nn.Module]] = {GPTConfig: GPT, BertConfig: Bert, LlamaConfig: Llama}
# the interleaved split is chosen for the run's micro-batches per step where the caller knows them
# (parallelize's num_microbatches), else for this many per pipeline stage
DEFAULT_MICROBATCHES_PER_STAGE = 4


def model_class(config: ModelConfig) -> type[torch.nn.Module]:
    """The model class a config builds (GPT for a GPTConfig, Bert for a BertConfig, Llama for a
    LlamaConfig)."""
    for config_class, cls in MODELS.items():
        if isinstance(config, config_class):
            return cls
    raise TypeError(f"no model for a {type(config).__name__}: models/parallelize.py MODELS knows "
                    f"{', '.join(c.__name__ for c in MODELS)}")


def config_class_for(saved: dict) -> type[ModelConfig]:
    """The config class of a saved model config dict (a checkpoint's `model_config`): the first in
    MODELS whose fields hold all its keys (GPT's, BERT's and Llama's each have keys the others lack)."""
    for config_class in MODELS:
        if set(saved) <= set(config_class.__dataclass_fields__):
            return config_class
    raise ValueError(f"no model config in models/parallelize.py MODELS has all of the keys {sorted(saved)}")


def _block_weight(config: ModelConfig) -> int:
    """Parameters of one transformer layer: attention, MLP, two LayerNorms."""
    h, ffn = config.hidden_size, config.ffn_hidden_size
    return 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h


def _gpt_weights(config: GPTConfig) -> tuple[int, int, int]:
    """(one layer, first stage's extra, last stage's extra): embeddings; final LayerNorm and the
    tied output layer's copy."""
    h, embedding = config.hidden_size, config.padded_vocab_size * config.hidden_size
    return _block_weight(config), embedding + config.seq_length * h, embedding + 2 * h


def _bert_weights(config: BertConfig) -> tuple[int, int, int]:
    """(one layer, first stage's extra, last stage's extra): embeddings; the MLM and sentence heads."""
    h, embedding = config.hidden_size, config.padded_vocab_size * config.hidden_size
    heads = embedding + 2 * h * h + 2 * h + config.padded_vocab_size
    return _block_weight(config), embedding + (config.seq_length + config.num_token_types) * h, heads


def _llama_weights(config: LlamaConfig) -> tuple[int, int, int]:
    """(one layer, first stage's extra, last stage's extra): a layer's q, [k; v], output
    projection, SwiGLU and two RMSNorms; the word embedding; final RMSNorm and the output layer
    (its own, or the tied embedding's copy: the same size)."""
    h, embedding = config.hidden_size, config.padded_vocab_size * config.hidden_size
    kv = 2 * config.num_query_groups * (h // config.num_attention_heads)
    return 2 * h * h + kv * h + 3 * h * config.ffn_hidden_size + 2 * h, embedding, embedding + h


def _gpt_flops(config: GPTConfig) -> tuple[int, int, int]:
    """Forward FLOPs per sequence: (one layer, the embedding lookup: none, the output layer and loss)."""
    h, s = config.hidden_size, config.seq_length
    return (layer_forward_flops(h, s, 4 * h * h + 2 * h * config.ffn_hidden_size), 0,
            head_forward_flops(h, s, config.padded_vocab_size))


def _bert_flops(config: BertConfig) -> tuple[int, int, int]:
    """Forward FLOPs per sequence: (one layer, none, the MLM head's transform and output layer and
    the pooler; the loss)."""
    h, s = config.hidden_size, config.seq_length
    return (layer_forward_flops(h, s, 4 * h * h + 2 * h * config.ffn_hidden_size), 0,
            head_forward_flops(h, s, config.padded_vocab_size, 2 * h * h))


def _llama_flops(config: LlamaConfig) -> tuple[int, int, int]:
    """Forward FLOPs per sequence: (one layer: q, [k; v], output projection, SwiGLU; none; the
    output layer and loss)."""
    h, s = config.hidden_size, config.seq_length
    kv = 2 * config.num_query_groups * (h // config.num_attention_heads)
    return (layer_forward_flops(h, s, 2 * h * h + kv * h + 3 * h * config.ffn_hidden_size), 0,
            head_forward_flops(h, s, config.padded_vocab_size))


# partition method -> config class -> (one layer, first stage's extra, last stage's extra)
_STAGE_WEIGHTS = {
    "parameters": {GPTConfig: _gpt_weights, BertConfig: _bert_weights, LlamaConfig: _llama_weights},
    "compute": {GPTConfig: _gpt_flops, BertConfig: _bert_flops, LlamaConfig: _llama_flops},
}


def _measured_weights(config: ModelConfig, tp_group=None, ep_group=None,
                      micro_batch_size: int = 1) -> tuple[list[int], int, int]:
    """partition_method "measured": a layer of each kind, the embeddings and the head and loss timed
    (forward + backward) on a micro-batch of `micro_batch_size` random sequences of seq_length
    tokens on the current default device (megazero.pipeline.stage_timing); GPT and Llama."""
    if isinstance(config, BertConfig):
        raise ValueError("pipeline partition_method 'measured' times GPT and Llama stages (a BERT micro-batch "
                         "has more inputs than it builds): use 'compute' or 'parameters' for BERT")
    experts = {"ep_group": ep_group} if getattr(config, "num_experts", None) is not None else {}

    def build(layers: range, pre_process: bool, post_process: bool) -> nn.Module:
        piece = model_class(config)(config, tp_group, layers, pre_process=pre_process, post_process=post_process,
                                    **experts)
        return _speed_options(piece, config)  # recomputation costs what it costs in training

    ids = torch.randint(0, config.vocab_size, (micro_batch_size, config.seq_length), generator=torch.Generator())
    kinds = [getattr(config, "num_experts", None) is not None and i % config.moe_layer_freq == 0
             for i in range(config.num_layers)]  # MoE layers and dense ones
    return measure_stage_weights(build, {"input_ids": ids, "labels": ids.roll(-1, dims=1)}, kinds)


def stage_weights(config: ModelConfig, partition_method: str = "parameters", tp_group=None, ep_group=None,
                  micro_batch_size: int = 1) -> tuple[list[int], int, int]:
    """(a weight per layer, the first stage's extra, the last stage's extra) that partition_method
    balances: parameter counts, forward FLOPs, or measured time (which times pieces of the model
    over tp_group / ep_group on every rank at once: call it collectively, as parallelize does)."""
    if partition_method not in PARTITION_METHODS:
        raise ValueError(f"pipeline partition_method {partition_method!r}: expected one of {list(PARTITION_METHODS)}")
    if partition_method == "measured":
        return _measured_weights(config, tp_group, ep_group, micro_batch_size)
    table = _STAGE_WEIGHTS[partition_method]
    weights = next((fn for cls, fn in table.items() if isinstance(config, cls)), None)
    if weights is None:
        raise TypeError(f"no pipeline stage weights for a {type(config).__name__} in models/parallelize.py")
    block, first_extra, last_extra = weights(config)
    return [block] * config.num_layers, first_extra, last_extra


def stage_layers(config: ModelConfig, num_stages: int, partition_method: str = "parameters", num_chunks: int = 1,
                 weights: tuple[list[int], int, int] | None = None,
                 num_microbatches: int | None = None) -> list[range]:
    """Each pipeline stage's layers (with num_chunks v > 1: each of the p x v virtual stages', chunk
    c of stage s at c * p + s). partition_method "parameters": balanced by parameter count (the
    embeddings count on the first stage, the head and the tied output layer's copy on the last),
    each virtual stage alone; "compute": by forward FLOPs (the output layer and loss over the
    vocabulary on the last stage, ~3 layers of GPT at hidden 192 and vocabulary 8192; the embedding
    lookup as none), so the last stage gets fewer layers; "measured": by the time stage_weights
    measures (pass its result as `weights`, else it is measured here, in this process alone). With
    v > 1 the compute and measured splits are the ones whose interleaved schedule simulates the
    shortest step at num_microbatches micro-batches (None: DEFAULT_MICROBATCHES_PER_STAGE per
    stage; megazero.pipeline.partition.simulated_interleaved_layers). Either way each layer keeps
    its number and parameter names, so checkpoints load at any split."""
    layer_weights, first_extra, last_extra = weights if weights is not None else stage_weights(config,
                                                                                               partition_method)
    if partition_method == "parameters" or num_chunks == 1:
        return balanced_stage_layers(layer_weights, num_stages * num_chunks, first_extra, last_extra)
    if num_microbatches is None:
        num_microbatches = DEFAULT_MICROBATCHES_PER_STAGE * num_stages
    return simulated_interleaved_layers(layer_weights, num_stages, num_chunks, num_microbatches, first_extra,
                                        last_extra)


def build_stage(config: ModelConfig, stage: int = 0, num_stages: int = 1, tp_group=None,
                ep_group=None, partition_method: str = "parameters", layers: range | None = None) -> torch.nn.Module:
    """Pipeline stage `stage` of `num_stages` of the model, over `tp_group` (None: unsharded), on
    the current default device, its MoE layers' experts split over `ep_group` (None: all here;
    only for a config with num_experts). Also builds the stages of another layout (checkpoint
    conversion builds them on the meta device); partition_method: as stage_layers; layers: the
    stage's layers where the caller split already (then partition_method is not used)."""
    if layers is None:
        layers = stage_layers(config, num_stages, partition_method)[stage]
    # the one place the expert-parallel group reaches a model: GPT's and Llama's MoE layers
    experts = {"ep_group": ep_group} if getattr(config, "num_experts", None) is not None else {}
    return model_class(config)(config, tp_group, layers, pre_process=stage == 0, post_process=stage == num_stages - 1,
                               **experts)


class Recomputed:
    """A module's forward, recomputed in backward instead of keeping its activations, while
    gradients are on (megazero.activation_checkpointing.checkpoint: the RNG states of the forward
    are restored, so dropout masks and gradients are exactly those without recomputation).

    The first `inputs` positional arguments are what the checkpoint keeps; the others (an
    attention mask) are closed over. partitionable: the kept inputs are the same on every
    tensor-parallel rank, so partition_activations may split them. Set as the module's own
    `forward` (`recompute(module, ...)`): no new submodule, so parameter names do not change.
    """

    def __init__(self, module: nn.Module, inputs: int, partitionable: bool):
        self.module, self.inputs, self.partitionable = module, inputs, partitionable

    def __call__(self, *args):
        forward = type(self.module).forward.__get__(self.module)  # the class's, not this wrapper
        if not torch.is_grad_enabled():
            return forward(*args)
        kept, rest = args[:self.inputs], args[self.inputs:]
        return checkpoint(lambda *kept: forward(*kept, *rest), *kept, partitionable=self.partitionable)


def recompute(module: nn.Module, inputs: int, partitionable: bool) -> None:
    """Recompute `module`'s forward in backward (see Recomputed)."""
    module.forward = Recomputed(module, inputs, partitionable)


def apply_recompute(model: nn.Module, config: ModelConfig) -> None:
    """config.recompute_granularity on this stage's layers `model.blocks`: "full": the first
    recompute_num_layers layers (all by default; per stage, as in Megatron) keep only their
    input; "selective": every attention core (`block.attn.core`) keeps only q, k and v.

    A layer's input is the same on every TP rank unless sequence parallelism splits it; q, k and
    v are this rank's heads, never partitionable. Generation with GPT's KV cache runs without
    gradients (GPT.generate), so it recomputes nothing (a recompute would write the cache twice)."""
    if config.recompute_granularity == "full":
        layers = config.recompute_num_layers if config.recompute_num_layers is not None else len(model.blocks)
        for block in list(model.blocks)[:layers]:
            recompute(block, inputs=1, partitionable=not config.sequence_parallel)
    elif config.recompute_granularity == "selective":
        for block in model.blocks:
            recompute(block.attn.core, inputs=3, partitionable=False)


class FusedBiasGeluMLP(nn.Module):
    """GPT's MLP with gelu(fc(x) + bias) in megazero's fused kernel on GPUs (cuda_ops.bias_gelu:
    torch's ops where the kernel is not built or does not take the input). Anywhere else it runs the
    MLP's own forward, so an MLP edited in a fork computes what it says on the CPU; on GPUs the edit
    needs `fused_kernels: false`. It holds the MLP's own fc and proj, so the parameter names are the
    MLP's."""

    def __init__(self, mlp: MLP):
        super().__init__()
        self.fc, self.proj = mlp.fc, mlp.proj
        # the MLP's forward, kept unregistered (registering the MLP would prefix every parameter name)
        object.__setattr__(self, "plain_forward", mlp.forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self.proj(bias_gelu(self.fc(x, add_bias=False), self.fc.bias))
        return self.plain_forward(x)


def apply_fused_kernels(model: GPT) -> None:
    """megazero's CUDA kernels in a GPT: every LayerNorm's (tp.LayerNorm.fused: on CUDA tensors,
    where built) and bias + GeLU in every MLP (FusedBiasGeluMLP; not in MoE layers' experts)."""
    for module in model.modules():
        if isinstance(module, tp.LayerNorm):
            module.fused = True
    for block in model.blocks:
        if isinstance(block.mlp, MLP):
            block.mlp = FusedBiasGeluMLP(block.mlp)


def apply_fused_rms_norm(model: nn.Module) -> None:
    """megazero's fused RMSNorm in every tp.RMSNorm of a Llama (tp.RMSNorm.fused: the CUDA kernel
    on CUDA tensors, the C++ op on CPU tensors, where built; torch's otherwise)."""
    for module in model.modules():
        if isinstance(module, tp.RMSNorm):
            module.fused = True


def _check_grid(config: ModelConfig, grid: ParallelGrid) -> None:
    if config.tensor_model_parallel_size != grid.tensor_model_parallel_size:
        raise ValueError(f"{type(config).__name__}.tensor_model_parallel_size is {config.tensor_model_parallel_size} "
                         f"but the grid's tensor-parallel size is {grid.tensor_model_parallel_size}: set the config's "
                         f"to the grid's")
    if grid.expert_model_parallel_size > 1 and getattr(config, "num_experts", None) is None:
        raise ValueError(f"the grid's expert_model_parallel_size is {grid.expert_model_parallel_size} but the "
                         f"{type(config).__name__} has no experts (num_experts None): set num_experts "
                         f"(--num-experts) or expert_model_parallel_size 1")


def _speed_options(model: torch.nn.Module, config: ModelConfig) -> torch.nn.Module:
    apply_recompute(model, config)
    if isinstance(config, GPTConfig) and config.fused_kernels:  # BertConfig has none: torch's kernels
        apply_fused_kernels(model)
    if isinstance(config, LlamaConfig) and config.fused_kernels:
        apply_fused_rms_norm(model)
    return model


def build_chunks(config: ModelConfig, stage: int, num_stages: int, num_chunks: int, tp_group=None,
                 ep_group=None, partition_method: str = "parameters",
                 split: list[range] | None = None) -> ModelChunks:
    """Stage `stage`'s model chunks for the interleaved schedule: chunk c is virtual stage c * p +
    stage of the model split into p * v stages (balanced as stage_layers, by partition_method; or
    `split`, the p * v virtual stages' layers, where the caller split already).
    Each chunk is built from the same generator state, so it draws the seeds a whole model does."""
    if split is None:
        split = stage_layers(config, num_stages, partition_method, num_chunks)
    state = torch.get_rng_state()
    chunks = []
    for c in range(num_chunks):
        torch.set_rng_state(state)
        virtual = chunk_stage(c, stage, num_stages)
        chunks.append(build_stage(config, virtual, num_stages * num_chunks, tp_group, ep_group, layers=split[virtual]))
    return ModelChunks(chunks)


def parallelize(config: ModelConfig, grid: ParallelGrid | None = None,
                num_layers_per_virtual_stage: int | None = None,
                partition_method: str = "parameters", micro_batch_size: int = 1,
                num_microbatches: int | None = None) -> torch.nn.Module:
    """This rank's module: its tensor-parallel shard of its pipeline stage of the model `config`
    describes (GPTConfig: GPT, BertConfig: Bert, LlamaConfig: Llama), with the config's recomputation and fused
    kernels; without a grid, the whole model in one process. Every rank draws the same random
    numbers here (one seed per layer), so each shard and stage starts as the slice of the
    single-process model built after the same seed.

    num_layers_per_virtual_stage (Megatron's --num-layers-per-virtual-pipeline-stage): split the
    model into PP x v virtual stages of that many layers (v = num_layers / (PP x it)) and give
    each rank v model chunks (megazero.pipeline.ModelChunks) for the interleaved schedule (v
    chunks of as many layers on average: the split into PP x v stages follows partition_method).

    partition_method (the engine config's pipeline.partition_method, --pipeline-partition-method):
    "parameters" balances the stages by parameter count, "compute" by forward FLOPs, "measured" by
    the time a layer, the embeddings and the head take here, timed on every rank at once (a
    collective: each rank of the world calls parallelize) on micro-batches of `micro_batch_size`
    sequences (see stage_layers); with v > 1 model chunks the compute and measured splits are chosen
    for a step of num_microbatches micro-batches (the gradient accumulation steps; None: 4 per
    stage), whose schedule the split changes (stage_layers)."""
    if partition_method not in PARTITION_METHODS:
        raise ValueError(f"pipeline partition_method {partition_method!r}: expected one of {list(PARTITION_METHODS)}")
    if grid is None:
        if num_layers_per_virtual_stage is not None:
            chunk_count(config.num_layers, 1, num_layers_per_virtual_stage)  # raises: needs PP >= 2
        return _speed_options(model_class(config)(config), config)
    _check_grid(config, grid)
    pp = grid.pipeline_model_parallel_size
    num_chunks = chunk_count(config.num_layers, pp, num_layers_per_virtual_stage)
    if pp == 1:
        return _speed_options(build_stage(config, 0, 1, grid.tp_group, grid.ep_group,
                                          layers=range(config.num_layers)), config)
    weights = stage_weights(config, partition_method, grid.tp_group, grid.ep_group, micro_batch_size)
    split = stage_layers(config, pp, partition_method, num_chunks, weights, num_microbatches)
    if num_chunks == 1:
        return _speed_options(build_stage(config, grid.pp_rank, pp, grid.tp_group, grid.ep_group,
                                          layers=split[grid.pp_rank]), config)
    model = build_chunks(config, grid.pp_rank, pp, num_chunks, grid.tp_group, grid.ep_group, split=split)
    for chunk in model.chunks:
        _speed_options(chunk, config)
    return model
