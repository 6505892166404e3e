"""Fused CUDA ops (csrc/cuda_kernels.cu) with their pure-torch references: LayerNorm, scaled masked
and causal softmax, bias + GeLU (tanh), and multi-tensor Adam/AdamW and LAMB optimizers.

Every public function takes the fused path only for CUDA tensors of a supported dtype and size when
the op is built (a CUDA build of torch and nvcc); otherwise it runs the reference, so callers never
need to check. `fused_available()` says which path is taken. Tests compare the two on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


# ---- references ----------------------------------------------------------------------------------
def layer_norm_reference(x, weight, bias, eps: float) -> torch.Tensor:
    """F.layer_norm over the last dimension, computed in fp32."""
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps).to(x.dtype)


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
    if fused_available(x, weight, bias) and x.dtype == weight.dtype:
        return _LayerNorm.apply(x, weight, bias, eps)
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def scaled_masked_softmax(scores, mask, scale: float = 1.0) -> torch.Tensor:
    """softmax(scale * scores) over [batch, heads, sq, sk], mask [batch, 1, sq, sk] (true = masked)."""
    if fused_available(scores) and scores.dim() == 4 and scores.shape[-1] <= SOFTMAX_MAX_COLUMNS:
        return _Softmax.apply(scores, mask, scale, False)
    return softmax_reference(scores, mask, scale, False)


def scaled_upper_triang_masked_softmax(scores, scale: float = 1.0) -> torch.Tensor:
    """Causal softmax(scale * scores) over [batch, heads, sq, sk] (position j > i masked)."""
    if fused_available(scores) and scores.dim() == 4 and scores.shape[-1] <= SOFTMAX_MAX_COLUMNS:
        return _Softmax.apply(scores, None, scale, True)
    return softmax_reference(scores, None, scale, True)


def bias_gelu(x, bias) -> torch.Tensor:
    """gelu_tanh(x + bias) (fused on CUDA)."""
    if fused_available(x, bias) and x.dtype == bias.dtype:
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


class FusedCUDAAdam(_CUDAMixin, FusedCPUAdam):
    """FusedCPUAdam's semantics in one multi-tensor CUDA launch per param group."""

    def _op_step(self, group, params, grads, copies, step: int) -> None:
        beta1, beta2 = group["betas"]
        self.op.multi_tensor_adam(params, grads, [self.state[p]["exp_avg"] for p in params],
                                  [self.state[p]["exp_avg_sq"] for p in params], group["lr"], beta1, beta2,
                                  group["eps"], group["weight_decay"], step, group["adamw_mode"],
                                  group["bias_correction"], self._scale())
        self._write_after(params, copies)


class FusedCUDALamb(_CUDAMixin, FusedCPULamb):
    """FusedCPULamb's semantics: moments and per-tensor norms in one launch, the update in another."""

    def _op_step(self, group, params, grads, copies, step: int) -> None:
        beta1, beta2 = group["betas"]
        self.op.multi_tensor_lamb(params, grads, [self.state[p]["exp_avg"] for p in params],
                                  [self.state[p]["exp_avg_sq"] for p in params], group["lr"], beta1, beta2,
                                  group["eps"], group["weight_decay"], step, group["bias_correction"],
                                  group["max_coeff"], group["min_coeff"], self._scale())
        self._write_after(params, copies)
