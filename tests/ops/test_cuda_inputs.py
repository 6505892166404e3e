"""The CUDA kernels on the inputs a first GPU run meets: empty, non-contiguous and broadcast-mask
inputs, inputs on the wrong device (a clear error, and the CUDA context still healthy after it),
fully masked rows, causal with sq != sk, fp16 near overflow, every op on a non-default stream,
and bitwise run-to-run reproducibility of LayerNorm backward. Skipped where there is no GPU."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from megazero.ops import cuda_ops
from megazero.ops.kernel_checks import KernelInputError
from tests.ops.cuda_tolerances import DTYPES, TOLERANCE

pytestmark = pytest.mark.cuda

if torch.version.cuda is None or not torch.cuda.is_available():
    pytest.skip("needs a GPU and a CUDA build of torch (this is a CPU run)", allow_module_level=True)

DEV = "cuda"


@pytest.fixture(scope="module")
def op():
    module = cuda_ops.cuda_op()
    if module is None:
        pytest.fail("the cuda_kernels op did not build on this GPU machine")
    return module


def _non_contiguous(shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """A random tensor of `shape` whose memory is laid out transposed (strides reversed)."""
    t = (scale * torch.randn(*reversed(shape), device=DEV)).to(dtype)
    return t.permute(*reversed(range(len(shape))))


def _check(fused_fn, reference_fn, inputs, dtype, upstream=None) -> None:
    """fused_fn against reference_fn (fp32 copies of the inputs), forward and backward."""
    # detach() keeps each input's strides (a clone would make some contiguous)
    fused_in = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    ref_in = [t.detach().float().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fused_fn(*fused_in)
    expected = reference_fn(*ref_in)
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
    grad = upstream if upstream is not None else torch.randn_like(expected)
    out.backward(grad.to(out.dtype))
    expected.backward(grad.float())
    for a, b in zip(fused_in, ref_in):
        if a is not None and a.grad is not None:
            torch.testing.assert_close(a.grad.float(), b.grad, **TOLERANCE[dtype])


def _ln(cols):
    return lambda x, w, b: F.layer_norm(x, (cols,), w, b, 1e-5)


# ---- empty inputs ------------------------------------------------------------------------------
def test_the_ops_return_empty_results_without_launching(op):
    for shape in [(0, 8), (3, 0), (2, 0, 8)]:
        x = torch.randn(shape, device=DEV)
        w, b = torch.ones(shape[-1], device=DEV), torch.zeros(shape[-1], device=DEV)
        y, mean, rstd = op.layer_norm_forward(x, w, b, 1e-5)
        dx, dw, db = op.layer_norm_backward(torch.ones_like(x), x, w, mean, rstd)
        assert y.shape == dx.shape == shape and torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, dw)
        assert op.bias_gelu_forward(x, b).shape == op.bias_gelu_backward(x, x, b).shape == shape
    for shape in [(0, 2, 3, 4), (2, 0, 3, 4), (2, 2, 0, 4), (2, 2, 3, 0)]:
        scores = torch.randn(shape, device=DEV)
        y = op.softmax_forward(scores, torch.zeros(shape[-2:], dtype=torch.bool, device=DEV), 1.0, True)
        assert y.shape == op.softmax_backward(torch.ones_like(y), y, 1.0).shape == shape
    empty = torch.zeros(0, device=DEV)
    adam_args = (1e-3, 0.9, 0.999, 1e-8, 0.0, 1, True, True, 1.0)
    op.multi_tensor_adam([], [], [], [], *adam_args)
    op.multi_tensor_adam([empty], [empty.clone()], [empty.clone()], [empty.clone()], *adam_args)
    op.multi_tensor_lamb([empty], [empty.clone()], [empty.clone()], [empty.clone()], 1e-3, 0.9, 0.999, 1e-8, 0.0, 1,
                         True, 10.0, 0.01, 1.0)
    torch.cuda.synchronize()  # an invalid launch would surface here at the latest


@pytest.mark.parametrize("cls", [cuda_ops.FusedCUDAAdam, cuda_ops.FusedCUDALamb])
def test_empty_groups_and_tensors_through_the_optimizers(cls):
    empty, full, no_grad = (torch.nn.Parameter(torch.randn(n, device=DEV)) for n in (0, 5000, 3))
    opt = cls([{"params": [empty]}, {"params": [full, torch.nn.Parameter(torch.zeros(0, device=DEV))]},
               {"params": [no_grad]}], lr=1e-2)
    empty.grad, full.grad = torch.zeros(0, device=DEV), torch.randn(5000, device=DEV)
    before = full.detach().clone()
    opt.step()
    torch.cuda.synchronize()
    assert not torch.equal(full.detach(), before) and torch.isfinite(full).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_inputs_through_the_wrappers(dtype):
    x = torch.randn(0, 64, device=DEV, dtype=dtype, requires_grad=True)
    w = torch.ones(64, device=DEV, dtype=dtype, requires_grad=True)
    b = torch.zeros(64, device=DEV, dtype=dtype, requires_grad=True)
    (cuda_ops.layer_norm(x, w, b).sum() + cuda_ops.bias_gelu(x, b).sum()).backward()
    assert x.grad.shape == (0, 64) and w.grad.shape == b.grad.shape == (64,)
    scores = torch.randn(2, 0, 5, 7, device=DEV, dtype=dtype)
    assert cuda_ops.scaled_upper_triang_masked_softmax(scores, 0.5).shape == scores.shape
    assert cuda_ops.scaled_masked_softmax(scores, torch.zeros(5, 7, dtype=torch.bool, device=DEV)).shape == scores.shape


# ---- layouts and masks -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(dtype):
    torch.manual_seed(0)
    x = _non_contiguous((33, 384), dtype)
    w = (1 + 0.1 * torch.randn(768, device=DEV)).to(dtype)[::2]
    b = (0.1 * torch.randn(768, device=DEV)).to(dtype)[::2]
    _check(lambda x, w, b: cuda_ops.layer_norm(x, w, b, 1e-5), _ln(384), [x, w, b], dtype,
           upstream=_non_contiguous((33, 384)))
    scores = _non_contiguous((2, 3, 5, 300), dtype)
    mask = _non_contiguous((2, 1, 5, 300)) > 0.5
    _check(lambda s: cuda_ops.scaled_masked_softmax(s, mask, 0.125),
           lambda s: cuda_ops.softmax_reference(s, mask, 0.125, False), [scores], dtype,
           upstream=_non_contiguous((2, 3, 5, 300)))
    h = _non_contiguous((64, 1536), dtype)
    bias = torch.randn(3072, device=DEV).to(dtype)[::2]
    _check(cuda_ops.bias_gelu, cuda_ops.bias_gelu_reference, [h, bias], dtype, upstream=_non_contiguous((64, 1536)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 257), (5, 257), (2, 3, 5, 257), (1, 1, 5, 1), (257,)])
def test_broadcast_masks(dtype, mask_shape):
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 5, 257, device=DEV, dtype=dtype)
    mask = torch.rand(mask_shape, device=DEV) < 0.3
    _check(lambda s: cuda_ops.scaled_masked_softmax(s, mask, 0.125),
           lambda s: cuda_ops.softmax_reference(s, mask, 0.125, False), [scores], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_are_zero(dtype):
    scores = torch.randn(2, 3, 6, 40, device=DEV, dtype=dtype)
    mask = torch.rand(2, 1, 6, 40, device=DEV) < 0.3
    mask[0, :, 2] = True  # one fully masked query row
    mask[1] = True  # a whole sequence masked
    _check(lambda s: cuda_ops.scaled_masked_softmax(s, mask, 1.0),
           lambda s: cuda_ops.softmax_reference(s, mask, 1.0, False), [scores], dtype)
    y = cuda_ops.scaled_masked_softmax(scores, mask, 1.0)
    assert torch.equal(y[1], torch.zeros_like(y[1])) and torch.equal(y[0, :, 2], torch.zeros_like(y[0, :, 2]))
    minus_inf = torch.full((1, 1, 2, 8), float("-inf"), device=DEV, dtype=dtype)  # nothing to normalise
    assert torch.equal(cuda_ops.scaled_upper_triang_masked_softmax(minus_inf, 1.0), torch.zeros_like(minus_inf))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5), (1, 300), (300, 1)])
def test_causal_with_sq_ne_sk(dtype, sq, sk):
    scores = torch.randn(2, 3, sq, sk, device=DEV, dtype=dtype)
    _check(lambda s: cuda_ops.scaled_upper_triang_masked_softmax(s, 0.3),
           lambda s: cuda_ops.softmax_reference(s, None, 0.3, True), [scores], dtype)


def test_fp16_near_overflow():
    torch.manual_seed(0)
    half = torch.float16
    big = ((torch.rand(2, 2, 8, 64, device=DEV) * 2 - 1) * 65000).to(half)
    for scale in (1.0, 1e-3):
        _check(lambda s, scale=scale: cuda_ops.scaled_masked_softmax(s, big[:, :1] > 30000, scale),
               lambda s, scale=scale: cuda_ops.softmax_reference(s, big[:, :1] > 30000, scale, False), [big], half)
    x = ((torch.rand(33, 512, device=DEV) * 2 - 1) * 60000).to(half)  # its variance overflows fp16, not fp32
    w, b = torch.ones(512, device=DEV, dtype=half), torch.zeros(512, device=DEV, dtype=half)
    _check(lambda x, w, b: cuda_ops.layer_norm(x, w, b, 1e-5), _ln(512), [x, w, b], half)
    bias = (100 * torch.randn(512, device=DEV)).to(half)
    y = cuda_ops.bias_gelu(x, bias)
    torch.testing.assert_close(y.float(), cuda_ops.bias_gelu_reference(x.float(), bias.float()).to(half).float(),
                               **TOLERANCE[half])
    assert torch.isfinite(y).all()


# ---- wrong devices -----------------------------------------------------------------------------
def test_wrong_device_inputs_raise_before_any_launch(op):
    scores = torch.randn(2, 3, 5, 7, device=DEV)
    cpu_mask = torch.zeros(2, 1, 5, 7, dtype=torch.bool)
    wrong_device = re.escape("mask must be on the scores' device cuda:0, got torch.bool on cpu")
    with pytest.raises(KernelInputError, match=wrong_device):
        cuda_ops.scaled_masked_softmax(scores, cpu_mask, 1.0)
    with pytest.raises(RuntimeError, match="softmax_forward: mask must be bool on cuda:0"):
        op.softmax_forward(scores, cpu_mask, 1.0, False)
    x, w, b = torch.randn(4, 8, device=DEV), torch.ones(8, device=DEV), torch.zeros(8, device=DEV)
    with pytest.raises(KernelInputError, match=re.escape("weight must be on x's device cuda:0")):
        cuda_ops.layer_norm(x, w.cpu(), b)
    with pytest.raises(KernelInputError, match=re.escape("bias must be torch.float32 (the weight's dtype)")):
        cuda_ops.layer_norm(x, w, b.half())
    with pytest.raises(RuntimeError, match="layer_norm_forward: bias must be Float on cuda:0 with 8 elements"):
        op.layer_norm_forward(x, w, b.cpu(), 1e-5)
    with pytest.raises(KernelInputError, match=re.escape("bias must be on x's device cuda:0")):
        cuda_ops.bias_gelu(x, b.cpu())
    with pytest.raises(RuntimeError, match="multi_tensor_adam: gradient 0 must be a contiguous"):
        op.multi_tensor_adam([w], [w.cpu()], [torch.zeros_like(w)], [torch.zeros_like(w)], 1e-3, 0.9, 0.999, 1e-8,
                             0.0, 1, True, True, 1.0)
    p = torch.nn.Parameter(torch.randn(10, device=DEV))
    p.grad = torch.randn_like(p)
    opt = cuda_ops.FusedCUDALamb([p])
    opt.step()
    opt.state[p]["exp_avg_sq"] = opt.state[p]["exp_avg_sq"].cpu()  # e.g. a state dict loaded onto the CPU
    with pytest.raises(KernelInputError, match=re.escape("exp_avg_sq 0 must be a contiguous float32 tensor on cuda:0")):
        opt.step()
    torch.cuda.synchronize()  # the context is still healthy
    assert torch.isfinite(cuda_ops.layer_norm(x, w, b)).all()


# ---- streams and reproducibility ----------------------------------------------------------------
def _every_op(inputs: dict) -> list[torch.Tensor]:
    """Every fused op forward and backward, and one step of each optimizer, on clones of `inputs`
    made on the current stream (so a kernel on another stream would read them before they exist)."""
    t = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    ln = cuda_ops.layer_norm(t["x"], t["w"], t["b"])
    sm = cuda_ops.scaled_masked_softmax(t["scores"], t["mask"], 0.2)
    causal = cuda_ops.scaled_upper_triang_masked_softmax(t["scores"], 0.2)
    gelu = cuda_ops.bias_gelu(t["x"], t["b"])
    (ln * t["dy"]).sum().backward(retain_graph=False)
    (sm.float().square().sum() + causal.float().square().sum() + (gelu * t["dy"]).sum()).backward()
    outs = [ln, sm, causal, gelu, t["x"].grad, t["w"].grad, t["b"].grad, t["scores"].grad]
    for cls in (cuda_ops.FusedCUDAAdam, cuda_ops.FusedCUDALamb):
        params = [torch.nn.Parameter(inputs["p"].clone()), torch.nn.Parameter(inputs["q"].clone())]
        params[0].grad, params[1].grad = inputs["gp"].clone(), inputs["gq"].clone()
        opt = cls(params, lr=1e-2, weight_decay=0.1)
        opt.grad_scale = torch.tensor(4.0, device=DEV)
        opt.step()
        outs += [p.detach() for p in params]
    return [o.detach() for o in outs]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_op_on_a_non_default_stream(dtype):
    torch.manual_seed(0)
    inputs = {"x": torch.randn(1024, 1024, device=DEV, dtype=dtype), "w": torch.randn(1024, device=DEV, dtype=dtype),
              "b": torch.randn(1024, device=DEV, dtype=dtype), "dy": torch.randn(1024, 1024, device=DEV, dtype=dtype),
              "scores": torch.randn(4, 8, 128, 128, device=DEV, dtype=dtype),
              "mask": torch.rand(4, 1, 1, 128, device=DEV) < 0.2, "p": torch.randn(300000, device=DEV),
              "q": torch.randn(77, device=DEV), "gp": torch.randn(300000, device=DEV),
              "gq": torch.randn(77, device=DEV)}
    expected = _every_op(inputs)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the side stream busy: a launch elsewhere would race ahead
        got = _every_op(inputs)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"output {i} differs on a non-default stream"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(33, 4100), (4096, 1024), (16384, 1600)])
def test_layer_norm_backward_is_bitwise_reproducible(dtype, rows, cols):
    torch.manual_seed(0)
    x = torch.randn(rows, cols, device=DEV, dtype=dtype)
    w = (1 + 0.1 * torch.randn(cols, device=DEV)).to(dtype)
    b = (0.1 * torch.randn(cols, device=DEV)).to(dtype)
    dy = torch.randn(rows, cols, device=DEV, dtype=dtype)

    def grads():
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        cuda_ops.layer_norm(xs, ws, bs).backward(dy)
        return xs.grad, ws.grad, bs.grad

    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
    F.layer_norm(xr, (cols,), wr, br, 1e-5).backward(dy.float())
    scale = max(1.0, rows / 1000)  # a sum over more rows carries more rounding (fp32 partials either way)
    tol = {k: v * scale for k, v in TOLERANCE[dtype].items()}
    torch.testing.assert_close(first[1].float(), wr.grad, **tol)
    torch.testing.assert_close(first[2].float(), br.grad, **tol)
