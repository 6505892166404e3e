"""megazero: Megatron-style model-parallel recipes with a DeepSpeed-shaped training engine."""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch
import torch.distributed as dist

from megazero.config import ConfigError, EngineConfig, parse_config
from megazero.distributed import init_distributed
from megazero.engine import Engine

__version__ = "0.1.0"
__all__ = ["initialize", "init_distributed", "add_config_arguments", "Engine", "EngineConfig", "ConfigError",
           "set_seed", "__version__"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add --deepspeed_config / --megazero_config (one engine JSON file) and --deepspeed to `parser`."""
    group = parser.add_argument_group("megazero", "engine configuration")
    group.add_argument("--megazero_config", "--deepspeed_config", dest="megazero_config", default=None,
                       help="engine JSON config (DeepSpeed-compatible)")
    group.add_argument("--deepspeed", "--megazero", dest="megazero", action="store_true",
                       help="accepted for DeepSpeed compatibility; the engine is always used")
    return parser


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _data_parallel_group(mpu):
    if mpu is None:
        return None
    return mpu.get_data_parallel_group()


def initialize(args=None, model: torch.nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, mpu=None, config=None, collate_fn=None):
    """Build the engine: returns (engine, optimizer, training_dataloader, lr_scheduler).

    `config` is a dict or JSON path (or comes from args.megazero_config / args.deepspeed_config).
    `optimizer` may be a built optimizer, or a callable taking parameters; otherwise the config's
    `optimizer` block builds one over `model_parameters` (default: all model parameters).
    `lr_scheduler` may be a scheduler or a callable taking the optimizer; otherwise the config's
    `scheduler` block builds one. `mpu` supplies get_data_parallel_group() when model parallelism
    is in use; otherwise the whole world is the data-parallel group.
    """
    from megazero.data.loader import DistributedBatchLoader
    from megazero.optim import build_optimizer, build_scheduler
    from megazero.precision import MasterParams

    if model is None:
        raise ValueError("initialize() needs a model")
    config = _config_source(args, config)
    if not dist.is_initialized():
        init_distributed()
    dp_group = _data_parallel_group(mpu)
    engine_config = parse_config(config, dist.get_world_size(dp_group))
    if engine_config.seed is not None:
        set_seed(engine_config.seed)
    if engine_config.compute_dtype != torch.float32:
        model = model.to(engine_config.compute_dtype)
    master = MasterParams(list(model.parameters()))
    optimizer = _build_or_adopt_optimizer(optimizer, engine_config, model, model_parameters, master,
                                          build_optimizer)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(optimizer)
    elif lr_scheduler is None and engine_config.scheduler is not None:
        lr_scheduler = build_scheduler(engine_config.scheduler.type, optimizer, engine_config.scheduler.params)
    loader = None
    if training_data is not None:
        loader = DistributedBatchLoader(training_data, engine_config.train_micro_batch_size_per_gpu,
                                        dist.get_rank(dp_group), dist.get_world_size(dp_group))
    engine = Engine(model, engine_config, optimizer, master, lr_scheduler, dp_group, loader)
    return engine, optimizer, loader, lr_scheduler


def _config_source(args, config):
    if config is not None:
        return config
    for name in ("megazero_config", "deepspeed_config"):
        path = getattr(args, name, None)
        if path:
            return path
    raise ConfigError("no engine config: pass config= (dict or JSON path) or --megazero_config/--deepspeed_config")


def _build_or_adopt_optimizer(optimizer, config: EngineConfig, model, model_parameters, master, build):
    if optimizer is None:
        if config.optimizer is None:
            raise ConfigError("no optimizer: pass optimizer= or add an 'optimizer' block to the config")
        params = list(model_parameters) if model_parameters is not None else list(model.parameters())
        if master.separate:
            params = _params_to_masters(params, master)
        return build(config.optimizer, params)
    if config.optimizer is not None:
        raise ConfigError("an optimizer was passed to initialize() and the config has an 'optimizer' block; "
                          "use one or the other")
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        params = list(model_parameters) if model_parameters is not None else list(model.parameters())
        return optimizer(_params_to_masters(params, master) if master.separate else params)
    master.adopt_optimizer(optimizer)
    return optimizer


def _params_to_masters(params: list, master) -> list:
    """Swap model parameters for their fp32 masters, keeping param-group dicts."""
    out = []
    for item in params:
        if isinstance(item, dict):
            out.append({**item, "params": [master.master_of(p) for p in item["params"]]})
        else:
            out.append(master.master_of(item))
    return out

