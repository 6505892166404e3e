"""Input checks of the fused CUDA ops, run by the wrappers in cuda_ops.py before any kernel launch.

Each `*_takes_kernel` function answers whether the fused kernel can take its inputs: False where
the pure-torch reference must run instead (empty inputs: a grid of 0 blocks is an invalid launch;
shapes or dtype mixes that torch handles and the kernel does not), and an `KernelInputError` that
names the tensor, expected vs got, for inputs that neither could take correctly (a mask on another
device would make the kernel read host memory and poison the CUDA context). The checks look only
at shapes, dtypes and devices, so they run, and are tested, on any device.
"""

from __future__ import annotations

import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class KernelInputError(ValueError):
    """An input that a fused kernel (and its reference) cannot take; the message says which and why."""


def _describe(t: torch.Tensor) -> str:
    layout = "contiguous" if t.is_contiguous() else "non-contiguous"
    return f"{t.dtype} on {t.device}, {layout}, shape {list(t.shape)}"


def _same_device(op: str, name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    if t.device != ref.device:
        raise KernelInputError(f"{op}: {name} must be on {ref_name} device {ref.device}, got {_describe(t)}")


def layer_norm_takes_kernel(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """Whether the fused LayerNorm takes (x, weight, bias). False (reference): no weight or bias,
    an empty x, or x in another dtype than weight and bias (torch's mixed-precision LayerNorm).
    Raises for a weight or bias on another device or not of x's last dimension, or a bias whose
    dtype differs from the weight's."""
    if weight is None or bias is None:
        return False
    op, cols = "layer_norm", x.shape[-1] if x.dim() else None
    for name, t in (("weight", weight), ("bias", bias)):
        _same_device(op, name, t, x, "x's")
        if x.dim() == 0 or tuple(t.shape) != (cols,):
            raise KernelInputError(f"{op}: {name} must have shape [{cols}] (x's last dimension), got {_describe(t)}")
    if bias.dtype != weight.dtype:
        raise KernelInputError(f"{op}: bias must be {weight.dtype} (the weight's dtype), got {_describe(bias)}")
    if x.dtype != weight.dtype or x.dtype not in KERNEL_DTYPES:
        return False
    return x.numel() > 0


def rms_norm_takes_kernel(x: torch.Tensor, weight: torch.Tensor | None,
                          dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES) -> bool:
    """Whether a fused RMSNorm (CUDA: any of KERNEL_DTYPES; CPU: `dtypes` float32/bfloat16) takes
    (x, weight). False (reference): no weight, an empty x, or x in another dtype than the weight
    or not in `dtypes`. Raises for a weight on another device or not of x's last dimension."""
    if weight is None:
        return False
    op, cols = "rms_norm", x.shape[-1] if x.dim() else None
    _same_device(op, "weight", weight, x, "x's")
    if x.dim() == 0 or tuple(weight.shape) != (cols,):
        raise KernelInputError(f"{op}: weight must have shape [{cols}] (x's last dimension), got {_describe(weight)}")
    if x.dtype != weight.dtype or x.dtype not in dtypes:
        return False
    return x.numel() > 0


def softmax_takes_kernel(scores: torch.Tensor, mask: torch.Tensor | None, max_columns: int) -> bool:
    """Whether the fused softmax takes scores [batch, heads, sq, sk] and an optional bool mask that
    broadcasts to them ([batch, 1, sq, sk], [batch, 1, 1, sk], [sq, sk], ...; true = masked out).
    False (reference): scores not 4-D, empty, or rows longer than `max_columns`. Raises for a mask
    on another device, not bool, or not broadcastable to the scores."""
    op = "scaled_masked_softmax"
    if mask is not None:
        _same_device(op, "mask", mask, scores, "the scores'")
        if mask.dtype != torch.bool:
            raise KernelInputError(f"{op}: mask must be torch.bool (true = masked out), got {_describe(mask)}")
        broadcasts = mask.dim() <= scores.dim() and all(
            m in (1, s) for m, s in zip(reversed(mask.shape), reversed(scores.shape)))
        if not broadcasts:
            raise KernelInputError(f"{op}: mask must broadcast to the scores' shape {list(scores.shape)}, "
                                   f"got {_describe(mask)}")
    if scores.dim() != 4 or scores.dtype not in KERNEL_DTYPES or scores.shape[-1] > max_columns:
        return False
    return scores.numel() > 0


def bias_gelu_takes_kernel(x: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether the fused bias + GeLU takes (x, bias). False (reference): an empty x, a bias that is
    not 1-D of x's last dimension (torch broadcasts it), or dtypes that differ (torch promotes).
    Raises for a bias on another device."""
    _same_device("bias_gelu", "bias", bias, x, "x's")
    if x.dim() == 0 or tuple(bias.shape) != (x.shape[-1],) or bias.dtype != x.dtype or x.dtype not in KERNEL_DTYPES:
        return False
    return x.numel() > 0


def optimizer_tensors(op: str, params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                      exp_avg_sqs: list[torch.Tensor]) -> list[int]:
    """Check one group's tensors for a multi-tensor optimizer launch and return the indices of the
    non-empty ones (the only ones to launch on; none: no launch). Per tensor: a contiguous fp32
    parameter and states on the first parameter's device, and a contiguous fp32, bf16 or fp16
    gradient of the same size there (the dtypes may differ between tensors)."""
    counts = (len(params), len(grads), len(exp_avgs), len(exp_avg_sqs))
    if len(set(counts)) != 1:
        raise KernelInputError(f"{op}: {counts[0]} parameters but {counts[1]} gradients, {counts[2]} exp_avg and "
                               f"{counts[3]} exp_avg_sq tensors")
    if not params:
        return []
    device = params[0].device
    for t, p in enumerate(params):
        for name, x, dtypes in (("parameter", p, (torch.float32,)), ("gradient", grads[t], KERNEL_DTYPES),
                                ("exp_avg", exp_avgs[t], (torch.float32,)),
                                ("exp_avg_sq", exp_avg_sqs[t], (torch.float32,))):
            if x.dtype not in dtypes or x.device != device or not x.is_contiguous() or x.numel() != p.numel():
                wanted = "/".join(str(d).removeprefix("torch.") for d in dtypes)
                raise KernelInputError(f"{op}: {name} {t} must be a contiguous {wanted} tensor on {device} with "
                                       f"{p.numel()} elements, got {_describe(x)} ({x.numel()} elements)")
    return [t for t, p in enumerate(params) if p.numel() > 0]
