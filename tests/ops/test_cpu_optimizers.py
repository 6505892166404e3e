"""The C++ CPU optimizer op against torch.optim / the reference LAMB (FusedCPULamb, use_op=False):
10 steps of random gradients, odd sizes (1, 7, one more than a vector, more than one OpenMP block),
fp32 and bf16 gradients, bf16/fp16 working copies, the unscale factor; identical results with 1 and 2 OpenMP threads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megazero.ops.cpu_optimizers import (
    FusedCPUAdagrad,
    FusedCPUAdam,
    FusedCPULamb,
    cpu_optimizers_op,
    grad_norm_squared,
)
from tests.conftest import REPO, repo_pythonpath

SIZES = [1, 7, 17, 70001]
STEPS = 10
RTOL = 1e-6


@pytest.fixture(scope="module", autouse=True)
def op():
    module = cpu_optimizers_op()
    if module is None:
        pytest.fail("the cpu_optimizers op did not build (see the warning); it must build on this machine")
    return module


def _run(make_ours, make_reference, size: int, grad_dtype=torch.float32, copy_dtype=None, scale: float = 1.0):
    torch.manual_seed(size)
    start = torch.randn(size)
    ours_p = torch.nn.Parameter(start.clone())
    ref_p = torch.nn.Parameter(start.clone())
    if grad_dtype != torch.float32:
        ours_p.grad_dtype = None  # let the fp32 master take a bf16 gradient
    ours, reference = make_ours([ours_p]), make_reference([ref_p])
    copy = torch.empty(size, dtype=copy_dtype) if copy_dtype else None
    if copy is not None:
        ours.set_copy_targets({id(ours_p): copy})
    for _ in range(STEPS):
        grad = torch.randn(size).to(grad_dtype)
        ours_p.grad = grad * scale if scale != 1.0 else grad
        ours.grad_scale = scale if scale != 1.0 else None
        ref_p.grad = grad.float()
        ours.step()
        reference.step()
    torch.testing.assert_close(ours_p.detach(), ref_p.detach(), rtol=RTOL, atol=1e-7)
    if copy is not None:
        assert torch.equal(copy, ours_p.detach().to(copy_dtype)), "the 16-bit copy is the rounded master"
    return ours


ADAM_CASES = [(True, 0.0), (True, 0.1), (False, 0.1)]


@pytest.mark.parametrize("adamw,decay", ADAM_CASES)
@pytest.mark.parametrize("size", SIZES)
def test_adam_matches_torch(size, adamw, decay):
    reference = torch.optim.AdamW if adamw else torch.optim.Adam
    _run(lambda p: FusedCPUAdam(p, lr=1e-2, weight_decay=decay, adamw_mode=adamw),
         lambda p: reference(p, lr=1e-2, weight_decay=decay), size)


@pytest.mark.parametrize("grad_dtype,copy_dtype", [(torch.bfloat16, None), (torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)])
@pytest.mark.parametrize("size", SIZES)
def test_adam_mixed_precision(size, grad_dtype, copy_dtype):
    _run(lambda p: FusedCPUAdam(p, lr=1e-2, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=1e-2,
                                                                                           weight_decay=0.1),
         size, grad_dtype, copy_dtype)


@pytest.mark.parametrize("size", SIZES)
def test_adam_unscales_in_the_same_pass(size):
    _run(lambda p: FusedCPUAdam(p, lr=1e-2), lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0), size,
         scale=1024.0)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16])
def test_lamb_matches_reference(size, copy_dtype):
    settings = dict(lr=1e-2, weight_decay=0.01, max_coeff=10.0, min_coeff=0.01)
    _run(lambda p: FusedCPULamb(p, **settings), lambda p: FusedCPULamb(p, **settings, use_op=False), size,
         copy_dtype=copy_dtype)


@pytest.mark.parametrize("size", SIZES)
def test_adagrad_matches_torch(size):
    _run(lambda p: FusedCPUAdagrad(p, lr=1e-2, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1),
         lambda p: torch.optim.Adagrad(p, lr=1e-2, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1),
         size)


@pytest.mark.parametrize("cls", [FusedCPUAdam, FusedCPULamb, FusedCPUAdagrad])
def test_reference_path_matches_op(cls):
    """The pure-torch fallback does the same arithmetic as the op."""
    torch.manual_seed(0)
    start = torch.randn(1001)
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    optimizers = [cls([params[0]], lr=1e-2, use_op=True), cls([params[1]], lr=1e-2, use_op=False)]
    for _ in range(STEPS):
        grad = torch.randn(1001)
        for p, opt in zip(params, optimizers):
            p.grad = grad.clone()
            opt.step()
    torch.testing.assert_close(params[0].detach(), params[1].detach(), rtol=RTOL, atol=1e-7)


def test_grad_norm_and_overflow():
    torch.manual_seed(0)
    tensors = [torch.randn(70001), torch.randn(7).bfloat16()]
    expected = sum(float(t.float().double().pow(2).sum()) for t in tensors)
    assert grad_norm_squared(tensors) == pytest.approx(expected, rel=1e-6)
    tensors[0][123] = float("inf")
    assert grad_norm_squared(tensors) == float("inf")
    tensors[0][123] = float("nan")
    assert grad_norm_squared(tensors) != grad_norm_squared(tensors)  # nan


_THREADS_SCRIPT = """
import torch
from megazero.ops.cpu_optimizers import FusedCPUAdam, FusedCPULamb, grad_norm_squared
torch.manual_seed(0)
out = {}
for cls in (FusedCPUAdam, FusedCPULamb):
    p = torch.nn.Parameter(torch.randn(300001))
    opt = cls([p], lr=1e-2, use_op=True)
    for _ in range(3):
        p.grad = torch.randn(300001)
        opt.step()
    out[cls.__name__] = p.detach().clone()
out["norm"] = torch.tensor(grad_norm_squared([torch.randn(300001)]), dtype=torch.float64)
torch.save(out, PATH)
"""


def test_results_do_not_depend_on_thread_count(tmp_path):
    results = []
    for threads in (1, 2):
        path = str(tmp_path / f"t{threads}.pt")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": repo_pythonpath()}
        script = _THREADS_SCRIPT.replace("PATH", repr(path))
        subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=REPO)
        results.append(torch.load(path))
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key]), key


def test_op_reports_its_instruction_set(op):
    assert op.isa() in ("avx512", "avx2", "generic")
