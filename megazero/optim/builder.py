"""Build a torch optimizer from the config's `optimizer` block (DeepSpeed's type names and meaning)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megazero.config import OptimizerConfig
from megazero.optim.lamb import Lamb


def _fused_ok(params: list) -> bool:
    """torch's fused Adam/AdamW runs on CPU and CUDA for floating tensors; use it when all agree."""
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    devices = {t.device.type for t in tensors}
    return len(devices) == 1 and devices <= {"cpu", "cuda"} and all(t.is_floating_point() for t in tensors)


def _on_cpu(params: list) -> bool:
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    return bool(tensors) and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def _on_cuda(params: list) -> bool:
    """All fp32 CUDA tensors and megazero's CUDA op built."""
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    if not tensors or not all(t.is_cuda and t.dtype == torch.float32 for t in tensors):
        return False
    from megazero.ops.cuda_ops import cuda_op

    return cuda_op() is not None


def _cpu_op_available() -> bool:
    from megazero.ops.cpu_optimizers import cpu_optimizers_op

    return cpu_optimizers_op() is not None


def build_optimizer(config: OptimizerConfig, params: Iterable) -> torch.optim.Optimizer:
    """Adam (DeepSpeed default adam_w_mode=True: decoupled weight decay), AdamW, SGD, Lamb or Adagrad.

    On CPU (fp32 masters) Adam/AdamW/Lamb/Adagrad use megazero's fused C++ op (one pass: unscale,
    update, 16-bit copy), on CUDA Adam/AdamW/Lamb its multi-tensor kernels, unless
    `torch_adam: true`; where the ops cannot be built, torch's fused Adam (and the pure-torch
    Lamb/Adagrad) run instead.
    """
    from megazero.ops.cpu_optimizers import FusedCPUAdagrad, FusedCPUAdam, FusedCPULamb

    params = list(params)
    kwargs = dict(config.params)
    kind = config.type.lower()
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    torch_only = kwargs.pop("torch_adam", False)
    use_op = not torch_only and _on_cpu(params) and _cpu_op_available()
    use_cuda_op = not torch_only and kind in ("adam", "adamw", "lamb") and _on_cuda(params)
    if kind in ("adam", "adamw"):
        decoupled = kwargs.pop("adam_w_mode", True) if kind == "adam" else True
        if not kwargs.pop("bias_correction", True):
            raise ValueError("optimizer.params.bias_correction=false is only supported by Lamb")
        kwargs.setdefault("weight_decay", 0.0)  # DeepSpeed's default (torch's AdamW would use 0.01)
        if (use_op or use_cuda_op) and not kwargs.get("amsgrad", False):
            kwargs.pop("amsgrad", None)
            if use_cuda_op:
                from megazero.ops.cuda_ops import FusedCUDAAdam

                return FusedCUDAAdam(params, adamw_mode=decoupled, **kwargs)
            return FusedCPUAdam(params, adamw_mode=decoupled, **kwargs)
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return cls(params, fused=_fused_ok(params), **kwargs)
    if kind == "sgd":
        return torch.optim.SGD(params, **kwargs)
    if kind == "adagrad":
        return FusedCPUAdagrad(params, **kwargs) if use_op else torch.optim.Adagrad(params, **kwargs)
    if use_cuda_op:
        from megazero.ops.cuda_ops import FusedCUDALamb

        return FusedCUDALamb(params, **kwargs)
    return FusedCPULamb(params, **kwargs) if use_op else Lamb(params, **kwargs)
