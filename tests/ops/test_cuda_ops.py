"""The CUDA kernels against their pure-torch references (fp32 within 1e-5 relative, bf16 within
1e-2), forward and backward; skipped with a reason where there is no GPU or no CUDA build."""

from __future__ import annotations

import pytest
import torch

from megazero.ops import cuda_ops
from tests.ops.cuda_tolerances import DTYPES, TOLERANCE

pytestmark = pytest.mark.cuda

if torch.version.cuda is None or not torch.cuda.is_available():
    pytest.skip("needs a GPU and a CUDA build of torch (this is a CPU run)", allow_module_level=True)



@pytest.fixture(scope="module", autouse=True)
def built():
    if cuda_ops.cuda_op() is None:
        pytest.fail("the cuda_kernels op did not build on this GPU machine")


def _compare(fused_fn, reference_fn, inputs: list[torch.Tensor], dtype) -> None:
    fused_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    ref_in = [t.detach().clone().float().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fused_fn(*fused_in)
    expected = reference_fn(*ref_in)
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
    upstream = torch.randn_like(expected)
    out.backward(upstream.to(out.dtype))
    expected.backward(upstream)
    for a, b in zip(fused_in, ref_in):
        if a.grad is not None:
            torch.testing.assert_close(a.grad.float(), b.grad, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [7, 384, 1024, 4100])
def test_layer_norm(dtype, cols):
    x = torch.randn(33, cols, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(cols, device="cuda")).to(dtype)
    b = (0.1 * torch.randn(cols, device="cuda")).to(dtype)
    _compare(lambda x, w, b: cuda_ops.layer_norm(x, w, b, 1e-5),
             lambda x, w, b: torch.nn.functional.layer_norm(x, (cols,), w, b, 1e-5), [x, w, b], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(33, 7), (33, 384), (2048, 384), (33, 4100)])
def test_rms_norm(dtype, rows, cols):
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(cols, device="cuda")).to(dtype)
    _compare(lambda x, w: cuda_ops.rms_norm(x, w, 1e-5), lambda x, w: cuda_ops.rms_norm_reference(x, w, 1e-5),
             [x, w], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_backward_is_bitwise_reproducible(dtype):
    x = torch.randn(8, 256, 384, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(384, device="cuda")).to(dtype)
    dy = torch.randn_like(x)

    def grads():
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        cuda_ops.rms_norm(xs, ws, 1e-5).backward(dy)
        return xs.grad, ws.grad

    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sk", [16, 257, 2048])
def test_masked_softmax(dtype, sk):
    scores = torch.randn(2, 3, 5, sk, device="cuda", dtype=dtype)
    mask = torch.rand(2, 1, 5, sk, device="cuda") < 0.3
    _compare(lambda s: cuda_ops.scaled_masked_softmax(s, mask, 0.125),
             lambda s: cuda_ops.softmax_reference(s, mask, 0.125, False), [scores], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq", [8, 255, 1024])
def test_causal_softmax(dtype, seq):
    scores = torch.randn(2, 4, seq, seq, device="cuda", dtype=dtype)
    _compare(lambda s: cuda_ops.scaled_upper_triang_masked_softmax(s, 0.1),
             lambda s: cuda_ops.softmax_reference(s, None, 0.1, True), [scores], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu(dtype):
    x = torch.randn(64, 1536, device="cuda", dtype=dtype)
    b = torch.randn(1536, device="cuda", dtype=dtype)
    _compare(cuda_ops.bias_gelu, cuda_ops.bias_gelu_reference, [x, b], dtype)


@pytest.mark.parametrize("cls,reference", [(cuda_ops.FusedCUDAAdam, "adamw"), (cuda_ops.FusedCUDALamb, "lamb")])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_multi_tensor_optimizers(cls, reference, grad_dtype):
    from megazero.ops.cpu_optimizers import FusedCPULamb  # use_op=False: the pure-torch LAMB

    torch.manual_seed(0)
    sizes = [1, 7, 4097, 100003]
    ours = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in sizes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for p in ours:
        p.grad_dtype = None
    opt = cls(ours, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1) if reference == "adamw" else \
        FusedCPULamb(theirs, lr=1e-2, weight_decay=0.1, use_op=False)
    for _ in range(10):
        for a, b in zip(ours, theirs):
            g = torch.randn_like(a).to(grad_dtype)
            a.grad, b.grad = g, g.float()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
