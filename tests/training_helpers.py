"""Module-level training functions that test pools run on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

import megazero
from megazero import parallel_state
from megazero.data import GPTDataset, IndexedDataset
from megazero.distributed import all_reduce_values
from megazero.tensor_parallel import merge_shards
from megazero.tensor_parallel.utils import partition_of
from megazero.zero import GatheredParameters
from models.gpt import GPTConfig
from models.llama import LlamaConfig
from models.parallelize import parallelize

# dropout on: exactness claims (resume, data-parallel layouts, recomputation) must hold for the
# random masks too; dropout 0 would hide any random state that is not restored or not shared
TINY = dict(vocab_size=256, seq_length=32, num_layers=2, hidden_size=64, num_attention_heads=4,
            make_vocab_size_divisible_by=64, dropout=0.1)
NO_DROPOUT = {"dropout": 0.0}  # for claims that dropout masks cannot satisfy, each saying why
# the tiny Llama: 4 query heads in 2 key/value groups (split over 2 TP ranks; num_query_groups 1
# replicates them), dropout on as TINY's
TINY_LLAMA = dict(vocab_size=256, seq_length=32, num_layers=2, hidden_size=64, num_attention_heads=4,
                  num_query_groups=2, ffn_hidden_size=128, make_vocab_size_divisible_by=64, dropout=0.1)
FAMILY = "family"  # a model_overrides key: the model family build_engine builds ("gpt" by default)
# a model_overrides key: Megatron's --num-layers-per-virtual-pipeline-stage (the interleaved schedule)
LAYERS_PER_VIRTUAL_STAGE = "num_layers_per_virtual_pipeline_stage"
PACKING = "packing"  # a model_overrides key: the GPTDataset's DocumentPacking (documents packed in a sample)
FAMILIES = {"gpt": (GPTConfig, TINY), "llama": (LlamaConfig, TINY_LLAMA)}


def base_config(**overrides) -> dict:
    """A small fp32 engine config; keyword overrides replace top-level keys."""
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 3,
                                                     "warmup_type": "linear"}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 20000},
        "steps_per_print": 1000,
    }
    config.update(overrides)
    return config


def build_engine(config: dict, prefix: str, seed: int = 0, model_overrides: dict | None = None,
                 layout: tuple[int, int] | None = None):
    """Seeded tiny GPT (or the model_overrides' FAMILY: TINY_LLAMA; LAYERS_PER_VIRTUAL_STAGE: model
    chunks for the interleaved schedule; PACKING: the samples' document fields) + engine over the
    indexed dataset at `prefix`; layout = (TP, PP) builds the model-parallel grid first (DP is what
    remains of the world)."""
    megazero.set_seed(seed)
    overrides = dict(model_overrides or {})
    config_class, tiny = FAMILIES[overrides.pop(FAMILY, "gpt")]
    virtual = overrides.pop(LAYERS_PER_VIRTUAL_STAGE, None)
    packing = overrides.pop(PACKING, None)
    grid = None
    if layout is not None:  # context parallelism: the model override context_parallel_size
        grid = parallel_state.initialize_model_parallel(*layout, context_parallel_size=overrides.get(
            "context_parallel_size", 1))
        overrides["tensor_model_parallel_size"] = layout[0]
    # the engine config's pipeline.partition_method and schedule, as the recipes read them
    pipeline = config.get("pipeline", {})
    model = parallelize(config_class(**{**tiny, **overrides}), grid, virtual, pipeline.get("partition_method",
                        "parameters"), pipeline_schedule=pipeline.get("schedule", "1f1b"))
    dataset = GPTDataset(IndexedDataset(prefix), TINY["seq_length"], seed=seed, packing=packing)
    engine, _, loader, _ = megazero.initialize(model=model, training_data=dataset, config=config,
                                               mpu=parallel_state if grid is not None else None)
    return engine, loader


def full_parameters(engine) -> dict[str, torch.Tensor]:
    """The whole model's parameters (TP shards merged, pipeline stages joined, global layer names)."""
    with GatheredParameters(list(engine.module.parameters())):  # whole again under ZeRO-3
        params = {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}
        meta = {name: partition_of(p) for name, p in engine.module.named_parameters()}
    grid = engine.grid
    if grid is None:
        return params
    if grid.tensor_model_parallel_size > 1:
        for name, (dim, stride) in meta.items():
            if dim is not None:
                shards = [torch.empty_like(params[name]) for _ in range(grid.tensor_model_parallel_size)]
                dist.all_gather(shards, params[name], group=grid.tp_group)
                params[name] = merge_shards(shards, dim, stride)
    renamed = {engine.module.global_parameter_name(name): value for name, value in params.items()}
    if grid.pipeline_model_parallel_size > 1:
        stages = [None] * grid.pipeline_model_parallel_size
        dist.all_gather_object(stages, renamed, group=grid.pp_group)
        renamed = {k: v for stage in stages for k, v in stage.items()}
    return renamed


def global_mean(value: float, engine) -> float:
    """Average a float over the data-parallel group."""
    return all_reduce_values([value], group=engine.dp_group)[0] / engine.dp_world_size


def train(config: dict, prefix: str, steps: int, seed: int = 0, save_dir: str | None = None,
          save_at: int | None = None, load_dir: str | None = None, model_overrides: dict | None = None,
          layout: tuple[int, int] | None = None) -> dict:
    """Train `steps` optimizer steps (after loading from load_dir, if given); returns per-step global
    losses and the final parameters. Saves at step `save_at` when save_dir is given."""
    engine, loader = build_engine(config, prefix, seed, model_overrides, layout)
    if load_dir is not None:
        path, client = engine.load_checkpoint(load_dir)
        assert path is not None and client["step"] == engine.global_steps
    data = iter(loader)
    losses = []
    while engine.global_steps < steps:
        loss = engine.train_batch(data)
        losses.append(global_mean(loss.item(), engine))
        if save_dir is not None and engine.global_steps == save_at:
            engine.save_checkpoint(save_dir, client_state={"step": engine.global_steps})
    return {"losses": losses, "params": full_parameters(engine), "skipped": engine.skipped_steps,
            "lr": engine.get_lr()[0], "scale": engine.get_loss_scale()}


SGD_LR = 1000.0  # large, so (before - after) / lr recovers the gradient to ~1e-7 relative in fp32


def first_step_gradients(prefix: str, layout: tuple[int, int] | None = None, model_overrides: dict | None = None,
                         config_overrides: dict | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the first global batch (the whole model, gathered), read off
    one plain SGD step: gradient = (before - after) / lr."""
    config = base_config(optimizer={"type": "SGD", "params": {"lr": SGD_LR}}, gradient_clipping=0.0,
                         **(config_overrides or {}))
    config.pop("scheduler")
    engine, loader = build_engine(config, prefix, 0, model_overrides, layout)
    before = full_parameters(engine)
    engine.train_batch(iter(loader))
    after = full_parameters(engine)
    return {name: (before[name] - after[name]) / SGD_LR for name in before}
