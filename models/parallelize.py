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
  tied to a copy on another stage.

The parameter counts and FLOPs the split balances are read off the model itself: its pieces
built on the meta device (`model_pieces`: one module per layer, the first stage without layers,
the last stage without layers), so they follow any edit to a model file.

The models are built with `speed_options=True`: each layer runs the config's recomputation
(recompute_granularity, recompute_num_layers) and fused kernels (fused_kernels), chosen in the
model's own constructors (models.common.SpeedOptions). Neither changes a parameter: names, the
state dict and the model contract stay those of the plain model (Model(config)); the engine and
checkpoints ask them only through the model contract (megazero.model_contract, models/README.md).

A new model is its file plus one line in MODELS: its class takes (config, tp_group, layers,
pre_process=, post_process=, speed_options=) and holds its layers in `blocks` (the stage
contract, models.common.StageContract); `example_batch(config, micro_batch_size)` on the class
lets the "measured" split time it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megazero import tensor_parallel as tp
from megazero.meta_device import skeleton
from megazero.model_contract import tied_parameters
from megazero.parallel_state import ParallelGrid
from megazero.pipeline.chunks import LOOP, ModelChunks, V, chunk_count, chunk_stage
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
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig

MODELS: dict[type, type[torch.nn.Module]] = {GPTConfig: GPT, BertConfig: Bert, LlamaConfig: Llama}
# the interleaved split is chosen for the run's micro-batches per step where the caller knows them
# (parallelize's num_microbatches), else for this many per pipeline stage
DEFAULT_MICROBATCHES_PER_STAGE = 4


def model_class(config: ModelConfig) -> type[torch.nn.Module]:
    """The model class a config builds (MODELS: GPT for a GPTConfig, Bert for a BertConfig, Llama
    for a LlamaConfig)."""
    for config_class, cls in MODELS.items():
        if isinstance(config, config_class):
            return cls
    raise TypeError(f"no model for a {type(config).__name__}: models/parallelize.py MODELS knows "
                    f"{', '.join(c.__name__ for c in MODELS)}")


def config_class_for(saved: dict) -> type[ModelConfig]:
    """The config class of a saved model config dict (a checkpoint's `model_config`, or a model
    config JSON): the class in MODELS whose fields are exactly its keys (a config's saved dict),
    else the first whose fields hold all of them (GPT's, BERT's and Llama's each have keys the
    others lack)."""
    exact = [c for c in MODELS if set(saved) == set(c.__dataclass_fields__)]
    holding = exact or [c for c in MODELS if set(saved) <= set(c.__dataclass_fields__)]
    if not holding:
        raise ValueError(f"no model config in models/parallelize.py MODELS has all of the keys {sorted(saved)}")
    return holding[0]


def _experts(config: ModelConfig, ep_group) -> dict:
    """The constructor argument of the expert-parallel group: only MoE configs (num_experts) take one."""
    return {"ep_group": ep_group} if getattr(config, "num_experts", None) is not None else {}


def model_pieces(config: ModelConfig) -> tuple[list[nn.Module], nn.Module, nn.Module]:
    """(each layer of the whole model, the first stage without layers, the last stage without
    layers), built on the meta device at TP = 1 with this layout's padded vocabulary: what a
    stage holds besides its layers is the first one's embeddings and the last one's head."""
    cls, whole = model_class(config), config.whole()
    with skeleton():
        layers = list(cls(whole).blocks)
        first = cls(whole, None, range(0), pre_process=True, post_process=False)
        last = cls(whole, None, range(0), pre_process=False, post_process=True)
    return layers, first, last


def _parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _matmul_parameters(module: nn.Module, config: ModelConfig, lookups: bool) -> float:
    """Weights a token multiplies by in `module`: its parameters of two or more dimensions (biases
    and norms have one), a mixture-of-experts layer's experts counted moe_router_topk /
    num_experts times (a token visits topk of them); lookups: embeddings are looked up, not
    multiplied (False where the output layer is the tied word embedding)."""
    looked_up = {id(p) for m in module.modules() if isinstance(m, (nn.Embedding, tp.VocabParallelEmbedding))
                 for p in m.parameters()} if lookups else set()
    total = 0.0
    for p in module.parameters():
        if p.dim() < 2 or id(p) in looked_up:
            continue
        share = config.moe_router_topk / config.num_experts if getattr(p, "megazero_expert", False) else 1
        total += p.numel() * share
    return total


def _parameter_weights(config: ModelConfig) -> tuple[list[int], int, int]:
    """partition_method "parameters": each layer's parameter count, the first stage's embeddings
    and the last stage's head (a tied output layer's copy included)."""
    layers, first, last = model_pieces(config)
    return [_parameters(layer) for layer in layers], _parameters(first), _parameters(last)


def _compute_weights(config: ModelConfig) -> tuple[list[int], int, int]:
    """partition_method "compute": forward FLOPs per sequence of each layer (2 per weight of its
    matmuls per token, plus the attention core's scores and weighted sum), of the first stage's
    embedding lookups and any other matmul there, and of the last stage's head with the loss over
    the vocabulary."""
    layers, first, last = model_pieces(config)
    h, s = config.hidden_size, config.seq_length
    return ([layer_forward_flops(h, s, round(_matmul_parameters(layer, config, lookups=False))) for layer in layers],
            2 * round(_matmul_parameters(first, config, lookups=True)) * s,
            head_forward_flops(s, config.padded_vocab_size, round(_matmul_parameters(last, config, lookups=False))))


def _measured_weights(config: ModelConfig, tp_group=None, ep_group=None,
                      micro_batch_size: int = 1) -> tuple[list[int], int, int]:
    """partition_method "measured": a layer of each kind (layers whose parameters have the same
    names and shapes cost the same), the embeddings and the head and loss timed (forward +
    backward) on the model class's example_batch(config, micro_batch_size) on the current default
    device (megazero.pipeline.stage_timing)."""
    cls = model_class(config)
    if not hasattr(cls, "example_batch"):
        raise ValueError(f"pipeline partition_method 'measured' times a stage on {cls.__name__}.example_batch(config, "
                         f"micro_batch_size), which {cls.__name__} does not define: use 'compute' or 'parameters'")

    def build(layers: range, pre_process: bool, post_process: bool) -> nn.Module:
        # recomputation and fused kernels cost what they cost in training
        return cls(config, tp_group, layers, pre_process=pre_process, post_process=post_process, speed_options=True,
                   **_experts(config, ep_group))

    kinds = [tuple((name, p.shape) for name, p in layer.named_parameters()) for layer in model_pieces(config)[0]]
    return measure_stage_weights(build, cls.example_batch(config, micro_batch_size), kinds)


def stage_weights(config: ModelConfig, partition_method: str = "parameters", tp_group=None, ep_group=None,
                  micro_batch_size: int = 1) -> tuple[list[int], int, int]:
    """(a weight per layer, the first stage's extra, the last stage's extra) that partition_method
    balances: parameter counts, forward FLOPs, or measured time (which times pieces of the model
    over tp_group / ep_group on every rank at once: call it collectively, as parallelize does)."""
    if partition_method not in PARTITION_METHODS:
        raise ValueError(f"pipeline partition_method {partition_method!r}: expected one of {list(PARTITION_METHODS)}")
    if partition_method == "measured":
        return _measured_weights(config, tp_group, ep_group, micro_batch_size)
    if partition_method == "compute":
        return _compute_weights(config)
    return _parameter_weights(config)


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
                ep_group=None, partition_method: str = "parameters", layers: range | None = None,
                speed_options: bool = False, cp_group=None) -> torch.nn.Module:
    """Pipeline stage `stage` of `num_stages` of the model, over `tp_group` (None: unsharded), on
    the current default device, its MoE layers' experts split over `ep_group` (None: all here;
    only for a config with num_experts). Also builds the stages of another layout (checkpoint
    conversion builds them on the meta device); partition_method: as stage_layers; layers: the
    stage's layers where the caller split already (then partition_method is not used);
    speed_options: with the config's recomputation and fused kernels (False: the plain model);
    cp_group: the context-parallel group (config.context_parallel_size > 1) splitting each sequence."""
    if layers is None:
        layers = stage_layers(config, num_stages, partition_method)[stage]
    context = {"cp_group": cp_group} if cp_group is not None else {}
    return model_class(config)(config, tp_group, layers, pre_process=stage == 0, post_process=stage == num_stages - 1,
                               speed_options=speed_options, **_experts(config, ep_group), **context)


def _check_grid(config: ModelConfig, grid: ParallelGrid) -> None:
    if config.tensor_model_parallel_size != grid.tensor_model_parallel_size:
        raise ValueError(f"{type(config).__name__}.tensor_model_parallel_size is {config.tensor_model_parallel_size} "
                         f"but the grid's tensor-parallel size is {grid.tensor_model_parallel_size}: set the config's "
                         f"to the grid's")
    cp = getattr(config, "context_parallel_size", None)
    if (cp or 1) != grid.context_parallel_size:
        why = "set the config's to the grid's" if cp is not None else "this model has no context parallelism (GPT, " \
                                                                      "Llama and BERT have)"
        raise ValueError(f"{type(config).__name__}.context_parallel_size is {cp} but the grid's context-parallel "
                         f"size is {grid.context_parallel_size}: {why}")
    if grid.expert_model_parallel_size > 1 and getattr(config, "num_experts", None) is None:
        raise ValueError(f"the grid's expert_model_parallel_size is {grid.expert_model_parallel_size} but the "
                         f"{type(config).__name__} has no experts (num_experts None): set num_experts "
                         f"(--num-experts) or expert_model_parallel_size 1")


def build_chunks(config: ModelConfig, stage: int, num_stages: int, num_chunks: int, tp_group=None,
                 ep_group=None, partition_method: str = "parameters",
                 split: list[range] | None = None, speed_options: bool = False, cp_group=None,
                 layout: str = LOOP) -> ModelChunks:
    """Stage `stage`'s model chunks: chunk c is virtual stage chunk_stage(c, stage, p, layout) of the
    model split into p * v stages (LOOP: c * p + stage, the interleaved schedule's; V: stage and
    2p - 1 - stage, zbv's), balanced as stage_layers, by partition_method; or `split`, the p * v
    virtual stages' layers, where the caller split already; speed_options: as build_stage's.
    Each chunk is built from the same generator state, so it draws the seeds a whole model does.
    Where one stage holds both the first and the last part (V), its two chunks share the word
    embedding the output layer is tied to, as the whole model does."""
    if split is None:
        split = stage_layers(config, num_stages, partition_method, num_chunks)
    state = torch.get_rng_state()
    chunks = []
    for c in range(num_chunks):
        torch.set_rng_state(state)
        virtual = chunk_stage(c, stage, num_stages, layout)
        chunks.append(build_stage(config, virtual, num_stages * num_chunks, tp_group, ep_group, layers=split[virtual],
                                  speed_options=speed_options, cp_group=cp_group))
    if layout == V and stage == 0:
        _share_tied(chunks[0], chunks[-1])
    return ModelChunks(chunks, layout)


def _share_tied(first: nn.Module, last: nn.Module) -> None:
    """Make the last part's copy of a tied parameter the first part's own (one stage holds both):
    one parameter, its gradient summed by autograd as in the whole model."""
    ours, theirs = tied_parameters(first), tied_parameters(last)
    if not ours or not theirs:
        return
    name = next(n for n, p in last.named_parameters() if p is theirs[0])
    owner, _, attribute = name.rpartition(".")
    setattr(last.get_submodule(owner), attribute, ours[0])


def parallelize(config: ModelConfig, grid: ParallelGrid | None = None,
                num_layers_per_virtual_stage: int | None = None,
                partition_method: str = "parameters", micro_batch_size: int = 1,
                num_microbatches: int | None = None, pipeline_schedule: str = "1f1b") -> torch.nn.Module:
    """This rank's module: its tensor-parallel shard of its pipeline stage of the model `config`
    describes (MODELS: GPTConfig: GPT, BertConfig: Bert, LlamaConfig: Llama), built with the
    config's recomputation and fused kernels (speed_options=True); without a grid, the whole model
    in one process. Every rank draws the same random numbers here (one seed per layer), so each
    shard and stage starts as the slice of the single-process model built after the same seed.

    num_layers_per_virtual_stage (Megatron's --num-layers-per-virtual-pipeline-stage): split the
    model into PP x v virtual stages of that many layers (v = num_layers / (PP x it)) and give
    each rank v model chunks (megazero.pipeline.ModelChunks) for the interleaved schedule (v
    chunks of as many layers on average: the split into PP x v stages follows partition_method).
    pipeline_schedule "zbv" (the engine config's pipeline.schedule): two model chunks per rank in
    the V layout (rank 0 holds the first and the last of the 2 x PP parts), balanced by parameters
    with partition_method "parameters", else by the method's weights as for 1F1B's 2 x PP stages.

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
        return model_class(config)(config, speed_options=True)
    _check_grid(config, grid)
    pp = grid.pipeline_model_parallel_size
    num_chunks = chunk_count(config.num_layers, pp, num_layers_per_virtual_stage)
    if pipeline_schedule == "zbv" and pp > 1 and num_layers_per_virtual_stage is None:  # (with it: initialize refuses)
        weights = stage_weights(config, partition_method, grid.tp_group, grid.ep_group, micro_batch_size)
        split = stage_layers(config, 2 * pp, partition_method, 1, weights)
        return build_chunks(config, grid.pp_rank, pp, 2, grid.tp_group, grid.ep_group, split=split,
                            speed_options=True, cp_group=grid.cp_group, layout=V)
    if pp == 1:
        return build_stage(config, 0, 1, grid.tp_group, grid.ep_group, layers=range(config.num_layers),
                           speed_options=True, cp_group=grid.cp_group)
    weights = stage_weights(config, partition_method, grid.tp_group, grid.ep_group, micro_batch_size)
    split = stage_layers(config, pp, partition_method, num_chunks, weights, num_microbatches)
    if num_chunks == 1:
        return build_stage(config, grid.pp_rank, pp, grid.tp_group, grid.ep_group, layers=split[grid.pp_rank],
                           speed_options=True, cp_group=grid.cp_group)
    return build_chunks(config, grid.pp_rank, pp, num_chunks, grid.tp_group, grid.ep_group, split=split,
                        speed_options=True, cp_group=grid.cp_group)
