"""megazero: Megatron-style model-parallel recipes with a DeepSpeed-shaped training engine."""

from __future__ import annotations

import argparse
import random
import warnings

import numpy as np
import torch
import torch.distributed as dist

from megazero import accelerator, parallel_state, tensor_parallel, zero  # noqa: F401  (as in DeepSpeed / Megatron)
from megazero.config import ConfigError, EngineConfig, parse_config
from megazero.distributed import init_distributed, settle_collectives_at_exit
from megazero.engine import Engine
from megazero.model_contract import tied_parameters
from megazero.parallel_state import grid_from_mpu
from megazero.tensor_parallel.random import seed_tracker
from megazero.watchdog import configure_watchdog

__version__ = "0.1.0"
__all__ = ["initialize", "init_distributed", "add_config_arguments", "Engine", "EngineConfig", "ConfigError",
           "set_seed", "zero", "accelerator", "__version__"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add --deepspeed_config / --megazero_config (one engine JSON file) and --deepspeed to `parser`."""
    group = parser.add_argument_group("megazero", "engine configuration")
    group.add_argument("--deepspeed_config", "--megazero_config", "--deepscale_config", dest="deepspeed_config",
                       default=None, help="engine JSON config (DeepSpeed-compatible)")
    group.add_argument("--deepspeed", "--megazero", "--deepscale", dest="deepspeed", action="store_true",
                       help="accepted for DeepSpeed compatibility; the engine is always used")
    return parser


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def initialize(args=None, model: torch.nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, mpu=None, config=None):
    """Build the engine: returns (engine, optimizer, training_dataloader, lr_scheduler).

    `config` is a dict or JSON path (or comes from args.megazero_config / args.deepspeed_config).
    `optimizer` may be a built optimizer, or a callable taking param groups; otherwise the config's
    `optimizer` block builds one over `model_parameters` (params or param-group dicts; default:
    all model parameters; a built optimizer keeps its own groups, with a warning when
    model_parameters differs). The optimizer ends up over fp32 master weights (partitioned under
    ZeRO). `lr_scheduler` may be a scheduler or a callable taking the optimizer; otherwise the
    config's `scheduler` block builds one (given both, the passed one wins, with a warning).
    `mpu` supplies get_data_parallel_group() when model parallelism is in use (pass
    `megazero.parallel_state` after initialize_model_parallel()); ZeRO then partitions over the
    data-parallel group only, and with pipeline stages train_batch() runs the 1F1B schedule.
    Otherwise the whole world is the data-parallel group.
    """
    from megazero.data.loader import DistributedBatchLoader
    from megazero.optim import build_optimizer, build_scheduler
    from megazero.zero import build_data_parallel_state
    from megazero.zero.model_broadcast import broadcast_model
    from megazero.zero.optimizer_check import check_zero_optimizer

    if model is None:
        raise ValueError("initialize() needs a model")
    config = _config_source(args, config)
    if not dist.is_initialized():
        init_distributed()
    settle_collectives_at_exit()  # also where the caller started torch.distributed itself
    grid = grid_from_mpu(mpu)
    dp_group = grid.dp_group if grid is not None else None
    # the batch triad counts the ranks that read different samples: DP without CP
    sample_shards = grid.sample_shards if grid is not None else dist.get_world_size(dp_group)
    engine_config = parse_config(config, sample_shards)
    _check_model_parallel(grid, engine_config)
    _check_model_chunks(model, grid, engine_config)
    if engine_config.seed is not None:
        set_seed(engine_config.seed)
    if grid is not None and grid.tensor_model_parallel_size > 1:  # per-TP-rank dropout in the TP regions
        seed_tracker(engine_config.seed if engine_config.seed is not None else torch.initial_seed() % 2**31,
                     grid.tp_rank)
    if engine_config.activation_checkpointing is not None:
        from megazero import activation_checkpointing

        activation_checkpointing.configure(mpu, **engine_config.activation_checkpointing.model_dump())
    if engine_config.compute_dtype != torch.float32:
        model = model.to(engine_config.compute_dtype)
    broadcast_model(model, dp_group, grid.expert_dp_group if grid is not None else None)  # one model on every replica
    groups = _muon_groups(_param_groups(optimizer, model_parameters, model, engine_config), model, engine_config)
    tied = tied_parameters(model)
    dp_state = build_data_parallel_state(engine_config, model, [g["params"] for g in groups], dp_group, isolate=tied,
                                         ep_group=grid.ep_group if grid is not None else None,
                                         expert_dp_group=grid.expert_dp_group if grid is not None else None)
    optimizer_groups = dp_state.optimizer_groups(groups)
    if optimizer is None:
        optimizer = build_optimizer(engine_config.optimizer, optimizer_groups)
    elif isinstance(optimizer, torch.optim.Optimizer):
        if len(optimizer_groups) > len(optimizer.param_groups):  # expert parallelism splits each group in two
            raise ValueError(f"the data-parallel state trains {len(optimizer_groups)} param groups (expert parameters "
                             f"in groups of their own), the optimizer passed to initialize() has "
                             f"{len(optimizer.param_groups)}: pass an optimizer callable or an 'optimizer' block")
        for group, new in zip(optimizer.param_groups, optimizer_groups):
            group["params"] = new["params"]
    else:
        optimizer = optimizer(optimizer_groups)
    _bind_averager(optimizer, model, dp_group, engine_config)  # its ZeRO refusal before any other check
    _bind_orthogonalizer(optimizer, dp_state, grid)
    check_zero_optimizer(engine_config, optimizer)
    optimizer = dp_state.optimizer_to_step(optimizer)  # offloaded: stepped sub-group by sub-group
    _warn_client_scheduler_wins(lr_scheduler, engine_config)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(optimizer)
    elif lr_scheduler is None and engine_config.scheduler is not None:
        lr_scheduler = build_scheduler(engine_config.scheduler.type, optimizer, engine_config.scheduler.params)
    loader = None
    if training_data is not None:
        loader = DistributedBatchLoader(training_data, engine_config.train_micro_batch_size_per_gpu,
                                        grid.sample_shard if grid is not None else dist.get_rank(dp_group),
                                        sample_shards)
    engine = Engine(model, engine_config, optimizer, dp_state, lr_scheduler, dp_group, loader, grid)
    configure_watchdog(engine_config.watchdog, engine)  # on when the config enables it; stops an earlier one
    return engine, optimizer, loader, lr_scheduler


def _check_model_parallel(grid, config: EngineConfig) -> None:
    if grid is None or grid.pipeline_model_parallel_size == 1:
        if config.pipeline.schedule != "1f1b":
            warnings.warn(f"pipeline.schedule {config.pipeline.schedule} has no effect without pipeline parallelism "
                          f"(pipeline_model_parallel_size 1)", stacklevel=3)
        return
    if config.zero_optimization.stage == 3:
        raise ConfigError(f"zero_optimization.stage 3 with pipeline_model_parallel_size "
                          f"{grid.pipeline_model_parallel_size}: ZeRO-3 is not supported with pipeline "
                          f"parallelism; use stage 1 or 2")
    schedule, pp = config.pipeline.schedule, grid.pipeline_model_parallel_size
    if schedule == "zbv" and config.gradient_accumulation_steps < 2 * pp:
        raise ConfigError(f"pipeline.schedule zbv needs at least 2 x {pp} stages = {2 * pp} micro-batches per step, "
                          f"got gradient_accumulation_steps {config.gradient_accumulation_steps} (train_batch_size "
                          f"{config.train_batch_size} / (micro-batch {config.train_micro_batch_size_per_gpu} x "
                          f"data-parallel ranks)): lower the micro-batch size (--micro-batch-size) or raise the "
                          f"global batch (--global-batch-size)")
    if config.gradient_accumulation_steps < grid.pipeline_model_parallel_size:
        warnings.warn(f"gradient_accumulation_steps {config.gradient_accumulation_steps} (the pipeline's "
                      f"micro-batches) < {grid.pipeline_model_parallel_size} stages: most of each step is "
                      f"pipeline bubble", stacklevel=3)


def _bind_averager(optimizer, model: torch.nn.Module, dp_group, config: EngineConfig) -> None:
    """An optimizer that averages over the data-parallel group itself (the 1-bit optimizers) gets
    the group; it needs whole, replicated gradients it can keep local, i.e. ZeRO stage 0, and no
    expert parameters (reduced over another group)."""
    from megazero.model_contract import is_expert_parameter
    from megazero.optim.protocol import DataParallelAverager

    if not isinstance(optimizer, DataParallelAverager):
        return
    name = type(optimizer).__name__
    if config.zero_optimization.stage != 0:
        raise ConfigError(f"optimizer {name} with zero_optimization.stage {config.zero_optimization.stage}: it "
                          f"compresses the whole momentum of every rank, which ZeRO partitions; use stage 0 "
                          f"(DeepSpeed refuses this combination too)")
    if any(is_expert_parameter(p) for p in model.parameters()):
        raise ConfigError(f"optimizer {name} with expert (MoE) parameters: their gradients are reduced over the "
                          f"expert-data-parallel group, which it does not compress; use Adam or Lamb")
    optimizer.bind_data_parallel(dp_group)


def _muon_groups(groups: list[dict], model: torch.nn.Module, config: EngineConfig) -> list[dict]:
    """The config's Muon splits each param group into its hidden matrices (Muon) and the rest
    (AdamW) before the data-parallel state flattens them (megazero.optim.muon.muon_param_groups)."""
    if config.optimizer is None or config.optimizer.type.lower() != "muon":
        return groups
    from megazero.optim.muon import DEFAULT_ADAMW_PARAMS, muon_param_groups

    return muon_param_groups(model, groups, config.optimizer.params.get("adamw_params", DEFAULT_ADAMW_PARAMS))


def _bind_orthogonalizer(optimizer, dp_state, grid) -> None:
    """An optimizer whose update reads whole matrices (Muon) gets the orthogonalizer that assembles
    them over the data-parallel state and the tensor-parallel group (megazero.zero.whole_matrices)."""
    from megazero.optim.muon import WholeMatrixOptimizer, orthogonalize
    from megazero.zero.whole_matrices import build_orthogonalizer

    if not isinstance(optimizer, WholeMatrixOptimizer):
        return
    try:
        optimizer.bind_orthogonalizer(build_orthogonalizer(dp_state, grid.tp_group if grid is not None else None,
                                                           orthogonalize))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_model_chunks(model: torch.nn.Module, grid, config: EngineConfig) -> None:
    """`pipeline.num_layers_per_virtual_stage`, when set, must be what the model was built with: the
    model chunks of this stage are num_layers / (PP x it) (megazero.pipeline.ModelChunks); the zbv
    schedule runs two chunks in the V layout, and no other schedule does."""
    from megazero.pipeline.chunks import V, chunk_count, chunk_layout, model_chunks

    layers = config.pipeline.num_layers_per_virtual_stage
    pp = grid.pipeline_model_parallel_size if grid is not None else 1
    if pp > 1 and (config.pipeline.schedule == "zbv") != (chunk_layout(model) == V):
        found = f"{len(model_chunks(model))} model chunk(s) in the {chunk_layout(model)} layout"
        raise ConfigError(f"'pipeline.schedule'={config.pipeline.schedule!r} and the model passed to initialize() "
                          f"has {found}: zbv runs (and only zbv runs) two chunks per stage in the v layout; build "
                          f"the model with models.parallelize.parallelize(config, grid, "
                          f"pipeline_schedule={config.pipeline.schedule!r})")
    if layers is None:
        return
    num_layers = getattr(getattr(model, "config", None), "num_layers", None)
    try:
        if num_layers is None:
            chunk_count(0, pp, layers)  # the PP check alone
            raise ValueError(f"the model has no config.num_layers to check it against (found "
                             f"{len(model_chunks(model))} model chunks on this stage)")
        expected = chunk_count(num_layers, pp, layers)
    except ValueError as e:
        raise ConfigError(f"'pipeline.num_layers_per_virtual_stage'={layers}: {e}") from None
    found = len(model_chunks(model))
    if found != expected:
        raise ConfigError(f"'pipeline.num_layers_per_virtual_stage'={layers} means {expected} model chunks per stage "
                          f"({num_layers} layers / (PP {pp} x {layers})), but the model passed to initialize() has "
                          f"{found}: build it with models.parallelize.parallelize(config, grid, "
                          f"num_layers_per_virtual_stage={layers}) (megazero.config.virtual_stage_layers(config) "
                          f"reads the key), or drop the key")


def _warn_client_scheduler_wins(lr_scheduler, config: EngineConfig) -> None:
    """As DeepSpeed (>= 0.9) does, a scheduler passed to initialize() replaces the config's
    `scheduler` block; say so rather than drop the block silently."""
    if lr_scheduler is not None and config.scheduler is not None:
        warnings.warn(f"initialize(lr_scheduler=...) is used and the config's 'scheduler' block "
                      f"({config.scheduler.type}) is ignored; remove one of them", stacklevel=3)


def _warn_model_parameters_ignored(model_parameters, optimizer: torch.optim.Optimizer) -> None:
    """A built optimizer brings its own param groups (DeepSpeed then ignores model_parameters too):
    warn when model_parameters says something else, i.e. other parameters or group options."""
    if model_parameters is None:
        return
    items = list(model_parameters)
    given = [p for item in items for p in (item["params"] if isinstance(item, dict) else [item])]
    options = any(isinstance(item, dict) and set(item) - {"params"} for item in items)
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    if options or {id(p) for p in given} != {id(p) for p in trained}:
        warnings.warn(f"initialize(model_parameters=...) is ignored: the optimizer passed to initialize() "
                      f"({type(optimizer).__name__}) trains its own {len(optimizer.param_groups)} param group(s) of "
                      f"{len(trained)} tensors (model_parameters named {len(given)} tensors"
                      f"{' with group options' if options else ''})", stacklevel=4)


def _config_source(args, config):
    path = next((p for p in (getattr(args, name, None) for name in ("deepspeed_config", "megazero_config")) if p),
                None)
    if config is not None and path is not None:  # as DeepSpeed: which one was meant is not ours to guess
        raise ConfigError(f"two engine configs: --deepspeed_config {path} in args and config= in initialize(); "
                          f"give one")
    if config is not None:
        return config
    if path is not None:
        return path
    raise ConfigError("no engine config: pass config= (dict or JSON path) or --deepspeed_config")


def _param_groups(optimizer, model_parameters, model: torch.nn.Module, config: EngineConfig) -> list[dict]:
    """The trainable model parameters as param-group dicts, from a built optimizer or model_parameters."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if config.optimizer is not None:
            raise ConfigError("an optimizer was passed to initialize() and the config has an 'optimizer' block; "
                              "use one or the other")
        if optimizer.state:
            raise ValueError("pass an optimizer that has not stepped yet: its state would not match the master "
                             "weights the engine creates")
        _warn_model_parameters_ignored(model_parameters, optimizer)
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": list(g["params"])}
                  for g in optimizer.param_groups]
    else:
        if optimizer is None and config.optimizer is None:
            raise ConfigError("no optimizer: pass optimizer= or add an 'optimizer' block to the config")
        items = list(model_parameters) if model_parameters is not None else list(model.parameters())
        groups = [dict(item) if isinstance(item, dict) else None for item in items]
        if all(g is None for g in groups):
            groups = [{"params": items}]
        elif any(g is None for g in groups):
            raise ValueError("model_parameters mixes tensors and param-group dicts")
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    for g in groups:
        g["params"] = [p for p in g["params"] if p.requires_grad]
        for p in g["params"]:
            if id(p) not in trainable:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} given to the optimizer is not a "
                                 f"trainable parameter of the model")
    return groups
