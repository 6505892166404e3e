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


def build_optimizer(config: OptimizerConfig, params: Iterable) -> torch.optim.Optimizer:
    """Adam (DeepSpeed default adam_w_mode=True: decoupled weight decay), AdamW, SGD or Lamb."""
    params = list(params)
    kwargs = dict(config.params)
    kind = config.type.lower()
    if kind in ("adam", "adamw"):
        decoupled = kwargs.pop("adam_w_mode", True) if kind == "adam" else True
        kwargs.pop("torch_adam", None)  # torch's implementation is the only one so far
        if not kwargs.pop("bias_correction", True):
            raise ValueError("optimizer.params.bias_correction=false is only supported by Lamb")
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        kwargs.setdefault("weight_decay", 0.0)  # DeepSpeed's default (torch's AdamW would use 0.01)
        return cls(params, fused=_fused_ok(params), **kwargs)
    if kind == "sgd":
        return torch.optim.SGD(params, **kwargs)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return Lamb(params, **kwargs)
