"""The optimizer registry: each `optimizer.type` (lower-case) to its params model and implementations.

An implementation is a factory `(params, **config params) -> torch.optim.Optimizer`:
- `cpu`: megazero's fused C++ op, taken when every parameter is an fp32 CPU tensor and the op
  builds (None: there is none);
- `cuda`: megazero's multi-tensor CUDA kernels, taken for fp32 CUDA parameters when they build;
- `reference`: pure torch on any device, taken otherwise and with `torch_adam: true`.
`megazero.optim.builder` picks one; the config validates `optimizer.params` against `params`.

To add an optimizer: one file with its torch class and params model (see lion.py), and its import
and one line in OPTIMIZERS here. Then regenerate the two files derived from the schema (tests fail
until you do): `python -m megazero.config schema > configs/megazero.schema.json` and
`python -m megazero.config docs-table --write docs/engine.md`. What the engine may ask of it beyond
torch's Optimizer: megazero.optim.protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from megazero.ops.cpu_optimizers import FusedCPUAdagrad, FusedCPUAdam, FusedCPULamb
from megazero.ops.cuda_ops import FusedCUDAAdam, FusedCUDALamb
from megazero.optim.lion import Lion, LionParams
from megazero.optim.muon import Muon, MuonParams
from megazero.optim.onebit import (
    OneBitAdam,
    OneBitAdamParams,
    OneBitLamb,
    OneBitLambParams,
    ZeroOneAdam,
    ZeroOneAdamParams,
)
from megazero.optim.params import AdagradParams, AdamParams, AdamWParams, LambParams, SGDParams

Factory = Callable[..., torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer type: its display name, params model and implementations (see the module doc)."""

    name: str
    params: type
    cpu: Factory | None
    cuda: Factory | None
    reference: Factory


def param_tensors(params: list) -> list[torch.Tensor]:
    """The tensors of a list of parameters or param-group dicts."""
    return [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]


def _fused_ok(params: list) -> bool:
    """torch's fused Adam/AdamW runs on CPU and CUDA for floating tensors; use it when all agree."""
    tensors = param_tensors(params)
    devices = {t.device.type for t in tensors}
    return len(devices) == 1 and devices <= {"cpu", "cuda"} and all(t.is_floating_point() for t in tensors)


# ---- Adam / AdamW: DeepSpeed's options, on top of whichever implementation runs ---------------------
def _adam(fused: Callable[..., torch.optim.Optimizer] | None, decoupled_only: bool) -> Factory:
    """A factory applying DeepSpeed's Adam rules, then `fused` (the op's class; None: torch's Adam).

    adam_w_mode (Adam only, default true) is decoupled weight decay; weight_decay defaults to 0
    (torch's AdamW would use 0.01); amsgrad always runs torch's optimizer (the ops keep no running
    maximum). bias_correction=false runs the op, or where torch's optimizer would (it has no such
    option) megazero's pure-torch Adam (FusedCPUAdam's reference path, any device).
    """

    def make(params: list, **kwargs) -> torch.optim.Optimizer:
        decoupled = True if decoupled_only else kwargs.pop("adam_w_mode", True)
        corrected = kwargs.pop("bias_correction", True)
        kwargs.setdefault("weight_decay", 0.0)
        if fused is not None and not kwargs.get("amsgrad", False):
            kwargs.pop("amsgrad", None)
            return fused(params, adamw_mode=decoupled, bias_correction=corrected, **kwargs)
        if not corrected:
            if kwargs.pop("amsgrad", False):
                raise ValueError("optimizer.params.bias_correction=false with amsgrad=true is not supported "
                                 "(torch's AMSGrad always corrects the bias)")
            return FusedCPUAdam(params, adamw_mode=decoupled, bias_correction=False, use_op=False, **kwargs)
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return cls(params, fused=_fused_ok(params), **kwargs)

    return make


def _lamb_reference(params: list, **kwargs) -> torch.optim.Optimizer:
    """FusedCPULamb's pure-torch path (the arithmetic tested against the op), on any device."""
    return FusedCPULamb(params, use_op=False, **kwargs)


def _adam_implementations(decoupled_only: bool) -> dict:
    return dict(cpu=_adam(FusedCPUAdam, decoupled_only), cuda=_adam(FusedCUDAAdam, decoupled_only),
                reference=_adam(None, decoupled_only))


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adam": OptimizerSpec("Adam", AdamParams, **_adam_implementations(decoupled_only=False)),
    "adamw": OptimizerSpec("AdamW", AdamWParams, **_adam_implementations(decoupled_only=True)),
    "sgd": OptimizerSpec("SGD", SGDParams, cpu=None, cuda=None, reference=torch.optim.SGD),
    "lamb": OptimizerSpec("Lamb", LambParams, cpu=FusedCPULamb, cuda=FusedCUDALamb, reference=_lamb_reference),
    "adagrad": OptimizerSpec("Adagrad", AdagradParams, cpu=FusedCPUAdagrad, cuda=None, reference=torch.optim.Adagrad),
    "lion": OptimizerSpec("Lion", LionParams, cpu=None, cuda=None, reference=Lion),
    "muon": OptimizerSpec("Muon", MuonParams, cpu=None, cuda=None, reference=Muon),
    # the compressed-communication ones (megazero.optim.onebit); DeepSpeed also spells it OnebitAdam
    "onebitadam": OptimizerSpec("OneBitAdam", OneBitAdamParams, cpu=OneBitAdam, cuda=None,
                                reference=partial(OneBitAdam, use_op=False)),
    "zerooneadam": OptimizerSpec("ZeroOneAdam", ZeroOneAdamParams, cpu=ZeroOneAdam, cuda=None,
                                 reference=partial(ZeroOneAdam, use_op=False)),
    "onebitlamb": OptimizerSpec("OneBitLamb", OneBitLambParams, cpu=OneBitLamb, cuda=None,
                                reference=partial(OneBitLamb, use_op=False)),
}
