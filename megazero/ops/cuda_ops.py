"""Fused CUDA ops (csrc/cuda_kernels.cu) with their pure-torch references: LayerNorm, RMSNorm, scaled masked
and causal softmax, bias + GeLU (tanh), and multi-tensor Adam/AdamW and LAMB optimizers.

Every public function takes the fused path only for CUDA tensors of a supported dtype and size when
the op is built (a CUDA build of torch and nvcc); otherwise it runs the reference, so callers never
need to check. `fused_available()` says which path is taken. Tests compare the two on a GPU. On
the fused path the inputs are checked first (kernel_checks.py): empty inputs take the reference
(no launch of 0 blocks), and inputs no path could take (e.g. a mask on another device) raise a
`KernelInputError` naming the tensor before anything is launched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megazero.ops import kernel_checks
from megazero.ops.builder import load_op
from megazero.ops.cpu_optimizers import FusedCPUAdam, FusedCPULamb

SOFTMAX_MAX_COLUMNS = 16384  # beyond this the reference runs (one block per row keeps a row in flight)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def cuda_op():
    """The compiled CUDA op, or None (CPU build of torch, no GPU, or a failed build)."""
    if torch.version.cuda is None or not torch.cuda.is_available():
        return None
    return load_op("cuda_kernels")


def fused_available(*tensors: torch.Tensor) -> bool:
    """True when these tensors would take the fused CUDA path."""
    return all(t.is_cuda and t.dtype in _DTYPES for t in tensors) and cuda_op() is not None


def _on_fused_device(x: torch.Tensor) -> bool:
    """x is a CUDA tensor and the op is built: the other inputs are then checked against x."""
    return x.is_cuda and cuda_op() is not None


# ---- references ----------------------------------------------------------------------------------
def layer_norm_reference(x, weight, bias, eps: float) -> torch.Tensor:
    """F.layer_norm over the last dimension, computed in fp32."""
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps).to(x.dtype)


def rms_norm_reference(x, weight, eps: float) -> torch.Tensor:
    """F.rms_norm over the last dimension (x / sqrt(mean(x^2) + eps) * weight), computed in fp32."""
    return F.rms_norm(x.float(), x.shape[-1:], weight.float(), eps).to(x.dtype)


def softmax_reference(scores, mask, scale: float, causal: bool) -> torch.Tensor:
    """softmax(scale * scores) with masked positions (mask true, or above the diagonal) at zero."""
    x = scores.float() * scale
    if causal:
        sq, sk = x.shape[-2:]
        x = x.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    if mask is not None:
        x = x.masked_fill(mask, float("-inf"))
    y = torch.softmax(x, dim=-1)
    return torch.nan_to_num(y, nan=0.0).to(scores.dtype)  # fully masked rows: zeros


def bias_gelu_reference(x, bias) -> torch.Tensor:
    """gelu_tanh(x + bias), computed in fp32."""
    return F.gelu(x.float() + bias.float(), approximate="tanh").to(x.dtype)


# ---- autograd wrappers ---------------------------------------------------------------------------
class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = cuda_op().layer_norm_forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = cuda_op().layer_norm_backward(dy, x, weight, mean, rstd)
        return dx, dweight, dbias, None


class _RMSNorm(torch.autograd.Function):
    """RMSNorm through `op` (this CUDA op, or the CPU op of cpu_norms.py: the same two functions)."""

    @staticmethod
    def forward(ctx, x, weight, eps, op):
        y, rstd = op.rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.op = op
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = ctx.op.rms_norm_backward(dy, x, weight, rstd)
        return dx, dweight, None, None


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, mask, scale, causal):
        y = cuda_op().softmax_forward(scores, mask, scale, causal)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return cuda_op().softmax_backward(dy, y, ctx.scale), None, None, None


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, bias)
        return cuda_op().bias_gelu_forward(x, bias)

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx = cuda_op().bias_gelu_backward(dy, x, bias)
        return dx, dx.reshape(-1, dx.shape[-1]).float().sum(0).to(bias.dtype)


def layer_norm(x, weight, bias, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension (fused on CUDA)."""
    if _on_fused_device(x) and kernel_checks.layer_norm_takes_kernel(x, weight, bias):
        return _LayerNorm.apply(x, weight, bias, eps)
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def rms_norm(x, weight, eps: float | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension (fused on CUDA); eps None: torch's default (the dtype's eps)."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    if _on_fused_device(x) and kernel_checks.rms_norm_takes_kernel(x, weight):
        return _RMSNorm.apply(x, weight, eps, cuda_op())
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def scaled_masked_softmax(scores, mask, scale: float = 1.0) -> torch.Tensor:
    """softmax(scale * scores) over [batch, heads, sq, sk]; the bool mask (true = masked) broadcasts
    to the scores: [batch, 1, sq, sk], [batch, 1, 1, sk], [sq, sk], ..."""
    if _on_fused_device(scores) and kernel_checks.softmax_takes_kernel(scores, mask, SOFTMAX_MAX_COLUMNS):
        return _Softmax.apply(scores, mask, scale, False)
    return softmax_reference(scores, mask, scale, False)


def scaled_upper_triang_masked_softmax(scores, scale: float = 1.0) -> torch.Tensor:
    """Causal softmax(scale * scores) over [batch, heads, sq, sk] (position j > i masked)."""
    if _on_fused_device(scores) and kernel_checks.softmax_takes_kernel(scores, None, SOFTMAX_MAX_COLUMNS):
        return _Softmax.apply(scores, None, scale, True)
    return softmax_reference(scores, None, scale, True)


def bias_gelu(x, bias) -> torch.Tensor:
    """gelu_tanh(x + bias) (fused on CUDA)."""
    if _on_fused_device(x) and kernel_checks.bias_gelu_takes_kernel(x, bias):
        return _BiasGelu.apply(x, bias)
    return F.gelu(x + bias, approximate="tanh")


# ---- optimizers ----------------------------------------------------------------------------------
class _CUDAMixin:
    """Multi-tensor CUDA launches instead of the CPU op; the 16-bit copies are written after."""

    def _check_param(self, p) -> None:
        if p.dtype != torch.float32 or not p.is_cuda:
            raise TypeError(f"{type(self).__name__} updates fp32 CUDA tensors, got {p.dtype} on {p.device}")

    @property
    def op(self):
        return cuda_op() if self._use_op is not False else None

    def _write_after(self, params, copies) -> None:
        if copies is not None:
            for p, c in zip(params, copies):
                c.copy_(p.view_as(c))

    def _launch_lists(self, params, grads):
        """The group's non-empty (params, grads, exp_avgs, exp_avg_sqs), checked before the launch
        (empty lists: nothing to launch)."""
        states = [self.state[p]["exp_avg"] for p in params], [self.state[p]["exp_avg_sq"] for p in params]
        keep = kernel_checks.optimizer_tensors(type(self).__name__, params, grads, *states)
        return [[x[t] for t in keep] for x in (params, grads, *states)]

    def _scale_args(self, device: torch.device) -> tuple[float, torch.Tensor | None]:
        """(host divisor, device divisor or None): a one-element CUDA `grad_scale` on the
        parameters' device is read by the kernels themselves, so the step needs no host sync."""
        scale = self.grad_scale
        if isinstance(scale, torch.Tensor) and scale.device == device and scale.numel() == 1:
            return 1.0, scale.reshape(1).float()
        return self._scale(), None


class FusedCUDAAdam(_CUDAMixin, FusedCPUAdam):
    """FusedCPUAdam's semantics in multi-tensor CUDA launches (per param group, one per gradient
    dtype and 64 tensors)."""

    def _op_step(self, group, params, grads, copies, step: int) -> None:
        beta1, beta2 = group["betas"]
        tensors = self._launch_lists(params, grads)
        if tensors[0]:
            self.op.multi_tensor_adam(*tensors, group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step,
                                      group["adamw_mode"], group["bias_correction"],
                                      *self._scale_args(tensors[0][0].device))
        self._write_after(params, copies)


class FusedCUDALamb(_CUDAMixin, FusedCPULamb):
    """FusedCPULamb's semantics: moments with per-block norm partials, per-tensor trust ratios, then
    the update (three launches per gradient dtype and 64 tensors of a group)."""

    def _op_step(self, group, params, grads, copies, step: int) -> None:
        beta1, beta2 = group["betas"]
        tensors = self._launch_lists(params, grads)
        if tensors[0]:
            self.op.multi_tensor_lamb(*tensors, group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step,
                                      group["bias_correction"], group["max_coeff"], group["min_coeff"],
                                      *self._scale_args(tensors[0][0].device))
        self._write_after(params, copies)
