"""The checks the fused CUDA wrappers run before any launch (megazero/ops/kernel_checks.py), on
CPU: they look only at shapes, dtypes and devices (a `meta` tensor stands in for "another
device"). Plus the reference semantics the kernels must match, through the same public wrappers
(on CPU they run the reference): empty inputs, broadcast masks, fully masked rows, causal with
sq != sk."""

from __future__ import annotations

import pytest
import torch

from megazero.ops import cuda_ops
from megazero.ops.kernel_checks import (
    KernelInputError,
    bias_gelu_takes_kernel,
    layer_norm_takes_kernel,
    optimizer_tensors,
    rms_norm_takes_kernel,
    softmax_takes_kernel,
)

MAX_COLS = cuda_ops.SOFTMAX_MAX_COLUMNS


# ---- LayerNorm -------------------------------------------------------------------------------------
def test_layer_norm_takes_matching_inputs():
    x, w, b = torch.randn(3, 8), torch.ones(8), torch.zeros(8)
    assert layer_norm_takes_kernel(x, w, b)
    assert layer_norm_takes_kernel(torch.randn(8, 3).t(), w, b)  # non-contiguous: the op copies it


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (4, 0)])
def test_layer_norm_empty_input_takes_the_reference(shape):
    cols = shape[-1]
    x, w, b = torch.randn(shape), torch.ones(cols), torch.zeros(cols)
    assert not layer_norm_takes_kernel(x, w, b)


def test_layer_norm_mixed_dtypes_and_missing_affine_take_the_reference():
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert not layer_norm_takes_kernel(x, torch.ones(8), torch.zeros(8))  # torch's mixed-precision LayerNorm
    assert not layer_norm_takes_kernel(x, None, None)


def test_layer_norm_bias_dtype_must_match_the_weight():
    x, w = torch.randn(3, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match=r"bias must be torch.bfloat16 \(the weight's dtype\), got torch.float"):
        layer_norm_takes_kernel(x, w, torch.zeros(8))


def test_layer_norm_weight_size_and_device_are_checked():
    x = torch.randn(3, 8)
    with pytest.raises(KernelInputError, match=r"weight must have shape \[8\].*got .*shape \[7\]"):
        layer_norm_takes_kernel(x, torch.ones(7), torch.zeros(8))
    with pytest.raises(KernelInputError, match=r"bias must be on x's device cpu, got torch.float32 on meta"):
        layer_norm_takes_kernel(x, torch.ones(8), torch.zeros(8, device="meta"))


def test_layer_norm_empty_through_the_wrapper():
    x = torch.randn(0, 8, requires_grad=True)
    w, b = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    y = cuda_ops.layer_norm(x, w, b)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert x.grad.shape == (0, 8) and torch.equal(w.grad, torch.zeros(8)) and torch.equal(b.grad, torch.zeros(8))


# ---- RMSNorm -------------------------------------------------------------------------------------
def test_rms_norm_checks():
    x, w = torch.randn(3, 8), torch.ones(8)
    assert rms_norm_takes_kernel(x, w)
    assert not rms_norm_takes_kernel(torch.randn(0, 8), w)  # empty: the reference
    assert not rms_norm_takes_kernel(x.bfloat16(), w)  # mixed dtypes: torch's
    assert not rms_norm_takes_kernel(x.half(), w.half(), (torch.float32, torch.bfloat16))  # not the CPU op's dtype
    assert not rms_norm_takes_kernel(x, None)
    with pytest.raises(KernelInputError, match=r"rms_norm: weight must have shape \[8\].*got .*shape \[7\]"):
        rms_norm_takes_kernel(x, torch.ones(7))
    with pytest.raises(KernelInputError, match=r"weight must be on x's device cpu, got torch.float32 on meta"):
        rms_norm_takes_kernel(x, torch.ones(8, device="meta"))
    y = cuda_ops.rms_norm(torch.randn(0, 8), w)
    assert y.shape == (0, 8)


# ---- softmax -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mask_shape", [(2, 1, 5, 7), (2, 1, 1, 7), (5, 7), (7,), (2, 3, 5, 7), (1, 1, 5, 1)])
def test_softmax_takes_broadcastable_masks(mask_shape):
    assert softmax_takes_kernel(torch.randn(2, 3, 5, 7), torch.zeros(mask_shape, dtype=torch.bool), MAX_COLS)


@pytest.mark.parametrize("mask_shape", [(2, 2, 5, 7), (3, 1, 5, 7), (5, 6), (1, 2, 1, 5, 7)])
def test_softmax_rejects_masks_that_do_not_broadcast(mask_shape):
    with pytest.raises(KernelInputError, match=r"mask must broadcast to the scores' shape \[2, 3, 5, 7\]"):
        softmax_takes_kernel(torch.randn(2, 3, 5, 7), torch.zeros(mask_shape, dtype=torch.bool), MAX_COLS)


def test_softmax_mask_device_and_dtype_are_checked():
    scores = torch.randn(2, 3, 5, 7)
    with pytest.raises(KernelInputError, match=r"mask must be on the scores' device cpu, got torch.bool on meta"):
        softmax_takes_kernel(scores, torch.zeros(2, 1, 5, 7, dtype=torch.bool, device="meta"), MAX_COLS)
    with pytest.raises(KernelInputError, match=r"mask must be torch.bool .*got torch.uint8"):
        softmax_takes_kernel(scores, torch.zeros(2, 1, 5, 7, dtype=torch.uint8), MAX_COLS)


@pytest.mark.parametrize("shape", [(0, 3, 5, 7), (2, 0, 5, 7), (2, 3, 0, 7), (2, 3, 5, 0)])
def test_softmax_empty_takes_the_reference(shape):
    assert not softmax_takes_kernel(torch.randn(shape), None, MAX_COLS)
    y = cuda_ops.scaled_upper_triang_masked_softmax(torch.randn(shape, requires_grad=True), 0.5)
    assert y.shape == shape


def test_softmax_other_shapes_take_the_reference():
    assert not softmax_takes_kernel(torch.randn(3, 5, 7), None, MAX_COLS)
    assert not softmax_takes_kernel(torch.randn(1, 1, 2, MAX_COLS + 1), None, MAX_COLS)
    assert not softmax_takes_kernel(torch.randn(1, 1, 2, 3, dtype=torch.float64), None, MAX_COLS)


def test_broadcast_masks_mean_what_the_full_mask_means():
    """[b,1,1,sk] (padding) and [sq,sk] masks give what their expansion to [b,1,sq,sk] gives; the
    GPU tests hold the kernel to this same reference."""
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 5, 7)
    for shape in [(2, 1, 1, 7), (5, 7)]:
        mask = torch.rand(shape) < 0.4
        full = mask.expand(2, 1, 5, 7).contiguous()
        torch.testing.assert_close(cuda_ops.scaled_masked_softmax(scores, mask, 0.3),
                                   cuda_ops.scaled_masked_softmax(scores, full, 0.3), rtol=0, atol=0)


def test_fully_masked_rows_are_zero_and_causal_allows_sq_ne_sk():
    scores = torch.randn(1, 2, 3, 4)
    mask = torch.zeros(1, 1, 3, 4, dtype=torch.bool)
    mask[..., 1, :] = True
    y = cuda_ops.scaled_masked_softmax(scores, mask, 1.0)
    assert torch.equal(y[:, :, 1], torch.zeros(1, 2, 4))
    torch.testing.assert_close(y[:, :, 0].sum(-1), torch.ones(1, 2))
    causal = cuda_ops.scaled_upper_triang_masked_softmax(torch.randn(1, 2, 3, 5), 1.0)  # query i sees keys <= i
    assert torch.equal(causal[..., 0, 1:], torch.zeros(1, 2, 4)) and torch.all(causal[..., 2, :3] > 0)
    assert torch.equal(causal[..., 2, 3:], torch.zeros(1, 2, 2))


# ---- bias + GeLU ---------------------------------------------------------------------------------
def test_bias_gelu_checks():
    x = torch.randn(4, 6)
    assert bias_gelu_takes_kernel(x, torch.randn(6))
    assert not bias_gelu_takes_kernel(torch.randn(0, 6), torch.randn(6))
    assert not bias_gelu_takes_kernel(x, torch.randn(1))  # torch broadcasts it
    assert not bias_gelu_takes_kernel(x, torch.randn(6, dtype=torch.bfloat16))  # torch promotes
    with pytest.raises(KernelInputError, match=r"bias must be on x's device cpu, got torch.float32 on meta"):
        bias_gelu_takes_kernel(x, torch.randn(6, device="meta"))
    empty = cuda_ops.bias_gelu(torch.randn(0, 6), torch.randn(6))
    assert empty.shape == (0, 6)


# ---- multi-tensor optimizers --------------------------------------------------------------------
def _group(sizes, grad_dtypes=None):
    params = [torch.randn(n) for n in sizes]
    grads = [torch.randn(n).to(d) for n, d in zip(sizes, grad_dtypes or [torch.float32] * len(sizes))]
    return params, grads, [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]


def test_optimizer_tensors_keep_the_non_empty_ones_and_allow_mixed_gradient_dtypes():
    group = _group([3, 0, 5, 0], [torch.float32, torch.bfloat16, torch.bfloat16, torch.float16])
    assert optimizer_tensors("Adam", *group) == [0, 2]
    assert optimizer_tensors("Adam", *_group([0, 0])) == []
    assert optimizer_tensors("Adam", [], [], [], []) == []


def test_optimizer_tensors_name_what_is_wrong():
    params, grads, m, v = _group([3, 5])
    with pytest.raises(KernelInputError, match=r"Adam: gradient 1 must be .* with 5 elements, got .*\(4 elements\)"):
        optimizer_tensors("Adam", params, [grads[0], torch.randn(4)], m, v)
    with pytest.raises(KernelInputError, match=r"exp_avg 0 must be a contiguous float32 tensor .*got torch.bfloat16"):
        optimizer_tensors("Adam", params, grads, [m[0].bfloat16(), m[1]], v)
    with pytest.raises(KernelInputError, match=r"exp_avg_sq 1 must be .*got torch.float32 on cpu, non-contiguous"):
        optimizer_tensors("Adam", params, grads, m, [v[0], torch.zeros(5, 2)[:, 0]])
    with pytest.raises(KernelInputError, match=r"gradient 0 must be a contiguous float32/float16/bfloat16 .*float64"):
        optimizer_tensors("Lamb", params, [grads[0].double(), grads[1]], m, v)
    with pytest.raises(KernelInputError, match=r"parameter 1 must be .* on cpu .*got torch.float32 on meta"):
        optimizer_tensors("Lamb", [params[0], torch.randn(5, device="meta")], grads, m, v)
    with pytest.raises(KernelInputError, match=r"2 parameters but 1 gradients, 2 exp_avg and 2 exp_avg_sq"):
        optimizer_tensors("Lamb", params, grads[:1], m, v)
