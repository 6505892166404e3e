"""The multi-tensor CUDA Adam/AdamW and LAMB against the CPU op (or, for fp16 gradients, which the
CPU op does not take, its pure-torch reference): several param groups (one of over 64 tensors,
so two launches), adamw_mode false, bias_correction false, grad_scale != 1 as a float and as a
device tensor, fp32/bf16/fp16 and mixed gradients, 16-bit copies; and LAMB bitwise run to run.
Skipped where there is no GPU."""

from __future__ import annotations

import pytest
import torch

from megazero.ops import cuda_ops
from megazero.ops.cpu_optimizers import FusedCPUAdam, FusedCPULamb

pytestmark = pytest.mark.cuda

if torch.version.cuda is None or not torch.cuda.is_available():
    pytest.skip("needs a GPU and a CUDA build of torch (this is a CPU run)", allow_module_level=True)

SIZES = [[1, 7, 4097], [100003] + [33] * 70]  # two groups; the second needs two launches
STEPS = 5
SCALE = 1024.0
CLASSES = {("adam", "cuda"): cuda_ops.FusedCUDAAdam, ("adam", "cpu"): FusedCPUAdam,
           ("lamb", "cuda"): cuda_ops.FusedCUDALamb, ("lamb", "cpu"): FusedCPULamb}
GRADS = {"fp32": [torch.float32], "bf16": [torch.bfloat16], "fp16": [torch.float16],
         "mixed": [torch.float32, torch.bfloat16]}
COPIES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "mixed": torch.bfloat16}


def _groups(params: list, kind: str) -> list[dict]:
    first, second = params[:len(SIZES[0])], params[len(SIZES[0]):]
    if kind == "adam":
        return [{"params": first, "adamw_mode": True, "weight_decay": 0.1},
                {"params": second, "adamw_mode": False, "weight_decay": 0.05, "bias_correction": False, "lr": 3e-3}]
    return [{"params": first, "weight_decay": 0.1},
            {"params": second, "weight_decay": 0.0, "bias_correction": False, "lr": 3e-3, "max_coeff": 5.0,
             "min_coeff": 0.05}]


def _attach(p: torch.nn.Parameter, grad: torch.Tensor) -> None:
    if grad.dtype != p.dtype:
        p.grad_dtype = None  # let the fp32 master take a 16-bit gradient
    try:
        p.grad = grad
    except RuntimeError as e:
        pytest.skip(f"torch {torch.__version__} cannot give an fp32 parameter a {grad.dtype} gradient: {e}")


def _train(kind: str, device: str, grads: str, scale_on_device: bool = False, use_op: bool | None = None):
    """STEPS steps from the same masters and gradients; (masters, 16-bit copies) on the CPU."""
    masters = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=masters).to(device)) for group in SIZES for n in group]
    opt = CLASSES[kind, device](_groups(params, kind), lr=1e-2, use_op=use_op)
    copy_dtype = COPIES[grads]
    copies = {id(p): torch.empty_like(p, dtype=copy_dtype) for p in params} if copy_dtype else {}
    opt.set_copy_targets(copies)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen) * SCALE
            _attach(p, g.to(GRADS[grads][i % len(GRADS[grads])]).to(device))
        opt.grad_scale = torch.tensor(SCALE, device=device) if scale_on_device else SCALE
        opt.step()
    return [p.detach().cpu() for p in params], [copies[id(p)].cpu() for p in params] if copies else []


@pytest.mark.parametrize("scale_on_device", [False, True], ids=["scale-float", "scale-tensor"])
@pytest.mark.parametrize("grads", list(GRADS))
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_cuda_optimizers_match_the_cpu_op(kind, grads, scale_on_device):
    cpu_use_op = None if grads != "fp16" else False  # the CPU op takes fp32/bf16 gradients only
    expected, expected_copies = _train(kind, "cpu", grads, use_op=cpu_use_op)
    got, got_copies = _train(kind, "cuda", grads, scale_on_device=scale_on_device)
    for i, (a, b) in enumerate(zip(got, expected)):
        # fp32 arithmetic in the same order, no FMA either side: at most an ulp or so apart (LAMB's
        # norms are summed in other blocks than the CPU op's)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m, i=i: f"tensor {i}: {m}")
    for master, a, b in zip(got, got_copies, expected_copies):
        assert torch.equal(a, master.to(a.dtype))  # the copy is the updated master, rounded
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-6)


def test_lamb_and_adam_are_bitwise_reproducible():
    for kind in ("lamb", "adam"):
        first, _ = _train(kind, "cuda", "mixed", scale_on_device=True)
        second, _ = _train(kind, "cuda", "mixed", scale_on_device=True)
        assert all(torch.equal(a, b) for a, b in zip(first, second)), kind
