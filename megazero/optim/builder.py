"""Build a torch optimizer from the config's `optimizer` block (DeepSpeed's type names and meaning).

Which implementation runs is the registry's (megazero.optim.registry): megazero's fused CPU op
for fp32 CPU parameters, its CUDA kernels for fp32 CUDA parameters, each where it builds and
unless `torch_adam: true`; the pure-torch reference otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from megazero.optim.registry import OPTIMIZERS, OptimizerSpec, param_tensors

if TYPE_CHECKING:  # the config reads the registry: a run-time import would be circular
    from megazero.config import OptimizerConfig


def _on_cpu(params: list) -> bool:
    """All fp32 CPU tensors and megazero's CPU op built."""
    tensors = param_tensors(params)
    if not tensors or not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return False
    from megazero.ops.cpu_optimizers import cpu_optimizers_op

    return cpu_optimizers_op() is not None


def _on_cuda(params: list) -> bool:
    """All fp32 CUDA tensors and megazero's CUDA op built."""
    tensors = param_tensors(params)
    if not tensors or not all(t.is_cuda and t.dtype == torch.float32 for t in tensors):
        return False
    from megazero.ops.cuda_ops import cuda_op

    return cuda_op() is not None


def pick_implementation(spec: OptimizerSpec, params: list, torch_only: bool = False):
    """The registry factory that runs for these parameters: cpu, cuda or reference."""
    if not torch_only:
        if spec.cpu is not None and _on_cpu(params):
            return spec.cpu
        if spec.cuda is not None and _on_cuda(params):
            return spec.cuda
    return spec.reference


def build_optimizer(config: OptimizerConfig, params: Iterable) -> torch.optim.Optimizer:
    """The optimizer `config.type` (any case; a key of OPTIMIZERS) over `params` (tensors or
    param-group dicts), with the `config.params` the user gave; see the module doc for which
    implementation runs."""
    kind = config.type.lower()
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer.type {config.type!r} is not registered; choose one of "
                         f"{', '.join(spec.name for spec in OPTIMIZERS.values())}")
    params = list(params)
    kwargs = dict(config.params)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    torch_only = kwargs.pop("torch_adam", False)
    return pick_implementation(OPTIMIZERS[kind], params, torch_only)(params, **kwargs)
