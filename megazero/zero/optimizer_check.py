"""DeepSpeed's `zero_allow_untested_optimizer`: at ZeRO stages 1-3 the optimizer steps this rank's
partition of the flattened masters, so an update that reads whole tensors (a trust ratio, a matrix
preconditioner) would see slices. Optimizers megazero builds are tested there; another optimizer
passed to initialize() is an error unless the config allows it, and then a warning."""

from __future__ import annotations

import warnings

import torch


def tested_optimizer_types() -> tuple[type, ...]:
    """The optimizer classes megazero builds (megazero.optim.registry) and tests under ZeRO."""
    from megazero.ops.cpu_optimizers import FusedCPUAdagrad, FusedCPUAdam, FusedCPULamb
    from megazero.ops.cuda_ops import FusedCUDAAdam, FusedCUDALamb
    from megazero.optim.lion import Lion
    from megazero.optim.muon import Muon  # assembles whole matrices itself (megazero.zero.whole_matrices)

    return (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, FusedCPUAdam, FusedCPULamb,
            FusedCPUAdagrad, FusedCUDAAdam, FusedCUDALamb, Lion, Muon)


def check_zero_optimizer(config, optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError for an untested optimizer at ZeRO stages 1-3 unless the EngineConfig
    `config` sets zero_allow_untested_optimizer (then warn), as DeepSpeed does."""
    stage = config.zero_optimization.stage
    if stage == 0 or type(optimizer) in tested_optimizer_types():
        return
    name = type(optimizer).__name__
    if not config.zero_allow_untested_optimizer:
        raise ValueError(f"optimizer {name} is untested with ZeRO stage {stage}: it steps this rank's slice of "
                         f"the flattened parameters, so an update that reads whole tensors would be wrong; set "
                         f"'zero_allow_untested_optimizer': true to use it (as in DeepSpeed)")
    warnings.warn(f"ZeRO stage {stage} with the untested optimizer {name} ('zero_allow_untested_optimizer' is "
                  f"true): its update must be elementwise to be right on partitions", stacklevel=3)
