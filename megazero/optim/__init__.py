"""Optimizers built from the engine config, and DeepSpeed's LR schedules."""

from megazero.optim.builder import build_optimizer
from megazero.optim.lamb import Lamb
from megazero.optim.lr_schedules import SCHEDULERS, build_scheduler

__all__ = ["build_optimizer", "build_scheduler", "Lamb", "SCHEDULERS"]
