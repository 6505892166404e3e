"""Optimizers built from the engine config (the registry names them), and DeepSpeed's LR schedules."""

from megazero.optim.builder import build_optimizer
from megazero.optim.lr_schedules import SCHEDULERS, build_scheduler
from megazero.optim.registry import OPTIMIZERS, OptimizerSpec

__all__ = ["build_optimizer", "build_scheduler", "OPTIMIZERS", "OptimizerSpec", "SCHEDULERS"]
