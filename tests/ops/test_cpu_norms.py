"""The fused CPU RMSNorm (megazero/ops/cpu_norms.py) against its pure-torch reference, forward and
backward, fp32 (1e-5) and bf16 (1e-2); the weight gradient independent of the thread count; the
inputs it does not take run torch's; and the Llama: fused_kernels off computes exactly what the
plain model does, on within the op's tolerance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero import tensor_parallel as tp
from megazero.ops import cpu_norms, cuda_ops
from megazero.tensor_parallel.random import MicroBatchStreams, get_rng_tracker, seed_tracker
from models.llama import Llama, LlamaConfig
from models.parallelize import parallelize
from tests.ops.cuda_tolerances import TOLERANCE


@pytest.fixture(scope="module", autouse=True)
def built():
    if cpu_norms.cpu_norms_op() is None:
        pytest.fail("the cpu_norms op did not build")


def _grads(fn, x, w, dy):
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(xs, ws)
    y.backward(dy)
    return y.detach(), xs.grad, ws.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 7), (2, 100, 384)])  # 200 rows: several row chunks and a partial one
def test_rms_norm_matches_the_reference(dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    dy = torch.randn(shape).to(dtype)
    got = _grads(lambda x, w: cpu_norms.rms_norm(x, w, 1e-5), x, w, dy)
    expected = _grads(lambda x, w: cuda_ops.rms_norm_reference(x, w, 1e-5), x.float(), w.float(), dy.float())
    for a, b in zip(got, expected):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b, **TOLERANCE[dtype])


def test_rms_norm_does_not_depend_on_the_thread_count_and_falls_back():
    torch.manual_seed(0)
    # 600 x 64: above the op's kParallelElements (32768), so the rows are split over the threads
    x, w, dy = torch.randn(600, 64), 1 + 0.1 * torch.randn(64), torch.randn(600, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _grads(cpu_norms.rms_norm, x, w, dy)
        torch.set_num_threads(max(2, threads))
        many = _grads(cpu_norms.rms_norm, x, w, dy)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, many))
    # fp16 and mixed dtypes are torch's (bitwise), an empty input too
    h, wh = x.half(), w.half()
    assert torch.equal(cpu_norms.rms_norm(h, wh, 1e-5), F.rms_norm(h, (64,), wh, 1e-5))
    assert torch.equal(cpu_norms.rms_norm(x.bfloat16(), w, 1e-5), F.rms_norm(x.bfloat16(), (64,), w, 1e-5))
    assert cpu_norms.rms_norm(torch.randn(0, 64), w).shape == (0, 64)


SHAPE = dict(vocab_size=256, seq_length=16, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
             make_vocab_size_divisible_by=64, dropout=0.1)


def _loss_and_grads(model):
    """One training forward + backward on the engine's keyed streams (MicroBatchStreams: the default
    generator seeded from (seed, step, micro-batch), the TP tracker emptied as at TP=1, both put
    back afterwards), so every model draws the same dropout masks whatever this process's
    generators and tracker hold. The attention dropout draws from the tracker when it has a state,
    and that state advances with each forward: seeded by an earlier test in the process, three
    models would draw three different masks."""
    ids = torch.randint(0, SHAPE["vocab_size"], (2, SHAPE["seq_length"] + 1),
                        generator=torch.Generator().manual_seed(1))
    with MicroBatchStreams(seed=1).micro_batch(step=0, index=0):
        loss = model(ids[:, :-1], labels=ids[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_llama_fused_kernels_off_is_the_plain_model_and_on_is_within_tolerance():
    def built(build, **kw):
        torch.manual_seed(0)
        return build(LlamaConfig(**SHAPE, **kw))

    plain, off, on = built(Llama), built(parallelize, fused_kernels=False), built(parallelize)
    norms = [m for m in on.modules() if isinstance(m, tp.RMSNorm)]
    assert len(norms) == 2 * SHAPE["num_layers"] + 1 and all(m.fused for m in norms)
    assert not any(m.fused for model in (plain, off) for m in model.modules() if isinstance(m, tp.RMSNorm))
    # the tracker as a test that seeds it in this process leaves it (tests/distributed/
    # test_bert_recompute_sp.py runs before this file in `make test`): the comparison must not see it
    tracker, saved = get_rng_tracker(), get_rng_tracker().get_states()
    seed_tracker(2, 0)
    try:
        plain_loss, plain_grads = _loss_and_grads(plain)
        off_loss, off_grads = _loss_and_grads(off)
        on_loss, on_grads = _loss_and_grads(on)
    finally:
        tracker.set_states(saved)
    assert torch.equal(plain_loss, off_loss)
    assert all(torch.equal(plain_grads[n], g) for n, g in off_grads.items())
    torch.testing.assert_close(on_loss, plain_loss, rtol=1e-5, atol=1e-5)
    for n, g in on_grads.items():
        torch.testing.assert_close(g, plain_grads[n], rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
