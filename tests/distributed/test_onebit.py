"""The 1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb) on 2 gloo ranks, dropout on.

- During the warm-up each equals its plain counterpart (Adam, LAMB) bit for bit.
- After it, each equals a plain transcription of its paper's update written here, on one process,
  fed the gradients every rank saw: the compression (a sign per element, one scale per 2,048
  elements, worker and server error feedback) simulated on them.
- A checkpoint taken after the warm-up resumes bit for bit (the compression errors, and 0/1 Adam's
  per-rank weights between synchronisations, saved per rank).
- ZeRO stages 1-3 are refused; fp16 agrees on skipped steps across ranks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megazero.config import ConfigError
from tests.training_helpers import base_config, build_engine, full_parameters, global_mean, train

BLOCK = 2048  # megazero.optim.compression.BLOCK, restated: the transcription is independent of it
STEPS = 9
LR = 3e-3
BETAS = (0.9, 0.9)  # a short warm-up settles a variance with beta2 0.9, not 0.999
COMMON = {"lr": LR, "betas": list(BETAS), "weight_decay": 0.1}
PLAIN = {"OneBitAdam": "Adam", "ZeroOneAdam": "Adam", "OneBitLamb": "Lamb"}
PADDED = {"vocab_size": 251}
WARM = {"OneBitAdam": {"freeze_step": 100}, "OneBitLamb": {"freeze_step": 100},
        "ZeroOneAdam": {"var_update_scaler": 100}}
# the compressed stage from step 4 on; 0/1 Adam: 2 variance updates per interval, then local steps
# from step 6 on, synchronised every 1, 2, 2, ... steps
COMPRESSED = {"OneBitAdam": {"freeze_step": 3}, "OneBitLamb": {"freeze_step": 3},
              "ZeroOneAdam": {"var_freeze_step": 5, "var_update_scaler": 2, "local_step_scaler": 2,
                              "local_step_clipper": 2}}


def _config(optimizer: str, params: dict, **extra) -> dict:
    return base_config(optimizer={"type": optimizer, "params": {**COMMON, **params}}, **extra)


def _train(config: dict, prefix: str, steps: int = STEPS, record: bool = False, model_overrides=None) -> dict:
    """Train; with `record`, every rank's (unscaled, clipped) gradients and each parameter's lr and
    weight decay at every step, gathered from all ranks, the initial weights and how many positions
    the compression left out for their zero variance."""
    engine, loader = build_engine(config, prefix, model_overrides=model_overrides)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    initial = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    records = []
    if record:
        optimizer, original = engine.optimizer, engine.optimizer.step

        def recording_step(closure=None):
            scale = optimizer._scale()
            records.append({names[id(p)]: (p.grad / scale, group["lr"], group["weight_decay"])
                            for group in optimizer.param_groups for p in group["params"]})
            return original(closure)

        optimizer.step = recording_step
    data = iter(loader)
    losses = [global_mean(engine.train_batch(data).item(), engine) for _ in range(steps)]
    out = {"losses": losses, "params": full_parameters(engine)}
    if record:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, records)
        averager = engine.optimizer._averager
        excluded = averager._padding.numel() - averager.layout.padding.numel() if averager is not None else 0
        out.update(records=every, initial=initial, excluded=excluded)
    return out


@pytest.mark.parametrize("optimizer", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_warmup_equals_the_plain_optimizer_bit_for_bit(pools, token_dataset_prefix_module, optimizer):
    plain = pools(2).run(_train, _config(PLAIN[optimizer], {"bias_correction": False}), token_dataset_prefix_module)
    onebit = pools(2).run(_train, _config(optimizer, WARM[optimizer]), token_dataset_prefix_module)
    for a, b in zip(plain, onebit):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    assert plain[0]["losses"][-1] < plain[0]["losses"][0]  # and it learns


# ---- the transcriptions: one process, every rank's gradients ------------------------------------
def _compress(values: torch.Tensor, error: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """sign x scale of values + error per BLOCK elements (scale: the root mean square of the live
    ones, squares summed in fp64); error <- what that leaves out. Elements not `live` carry nothing."""
    total = torch.where(live, values + error, 0.0)
    out = torch.empty_like(total)
    for start in range(0, total.numel(), BLOCK):
        block, alive = total[start:start + BLOCK], live[start:start + BLOCK]
        scale = (block.double().square().sum() / max(1, int(alive.sum()))).sqrt().float()
        out[start:start + BLOCK] = torch.where(block >= 0, scale, -scale)
    out[~live] = 0.0
    error.copy_(total - out)
    return out


# Adam's own bound on |m| / sqrt(v) (Kingma and Ba), and on |g| / sqrt(v) with g in v: what the
# compressed stages clamp the preconditioned values to
MOMENTUM_BOUND = (1 - BETAS[0]) / math.sqrt(1 - BETAS[1]) / (1 - BETAS[0] / math.sqrt(BETAS[1]))
GRADIENT_BOUND = 1 / math.sqrt(1 - BETAS[1])


def _average(values: list[torch.Tensor], worker_errors: list[torch.Tensor], server_error: torch.Tensor,
             denominator: torch.Tensor, bound: float = math.inf) -> torch.Tensor:
    """1-bit Adam's two-phase average, in the preconditioned space: every worker compresses its
    value / denominator, the server averages what it got and compresses that; times the denominator
    again. Every block has one server, so one server error per tensor does it. Zero-variance
    elements (denominator = eps) are left out."""
    live = (denominator != 1e-8).flatten()
    flat = denominator.flatten()
    decoded = [_compress((v.flatten() / flat).clamp(-bound, bound), e, live) for v, e in zip(values, worker_errors)]
    mean = decoded[0].clone()
    for d in decoded[1:]:
        mean += d
    mean /= len(decoded)
    return (_compress(mean, server_error, live) * flat).view_as(values[0])


class _Transcription:
    """Per-parameter state of every rank (equal on all ranks except where the algorithm says)."""

    def __init__(self, initial: dict, ranks: int):
        self.ranks = ranks
        self.p = {n: [w.clone() for _ in range(ranks)] for n, w in initial.items()}
        self.m = {n: [torch.zeros_like(w) for _ in range(ranks)] for n, w in initial.items()}
        self.v = {n: torch.zeros_like(w) for n, w in initial.items()}
        self.worker = {n: [torch.zeros(w.numel()) for _ in range(ranks)] for n, w in initial.items()}
        self.server = {n: torch.zeros(w.numel()) for n, w in initial.items()}

    def adam(self, name: str, g: torch.Tensor, lr: float, wd: float) -> None:
        """megazero's Adam (no bias correction) on an averaged gradient, the same on every rank."""
        m, v = self.m[name][0].lerp(g, 1 - BETAS[0]), self.v[name]
        v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
        p = self.p[name][0] * (1 - lr * wd)
        p.addcdiv_(m, v.sqrt() + 1e-8, value=-lr)
        self.m[name] = [m.clone() for _ in range(self.ranks)]
        self.p[name] = [p.clone() for _ in range(self.ranks)]

    def frozen_adam(self, name: str, m: torch.Tensor, lr: float, wd: float) -> None:
        """Adam's update with a given (averaged) momentum and the frozen variance."""
        p = self.p[name][0] * (1 - lr * wd)
        p.addcdiv_(m, self.v[name].sqrt() + 1e-8, value=-lr)
        self.m[name] = [m.clone() for _ in range(self.ranks)]
        self.p[name] = [p.clone() for _ in range(self.ranks)]


def _one_bit_adam(initial: dict, records: list[list[dict]], freeze: int) -> dict:
    """Tang et al.: Adam for `freeze` steps; then each rank's momentum with its own gradient,
    averaged compressed, and Adam's update with the frozen variance. The momentum is kept as
    megazero keeps it, preconditioned: u = m / (sqrt(v) + eps), so the update is p -= lr u."""
    t = _Transcription(initial, len(records))
    u = {}
    for step, per_rank in enumerate(zip(*records), start=1):
        for name in initial:
            g, lr, wd = per_rank[0][name]
            if step <= freeze:
                t.adam(name, g, lr, wd)
                continue
            denominator = t.v[name].sqrt() + 1e-8
            if name not in u:
                u[name] = t.m[name][0] / denominator
            local = [(u[name] * BETAS[0] + (1 - BETAS[0]) * (per_rank[r][name][0] / denominator))
                     .clamp(-MOMENTUM_BOUND, MOMENTUM_BOUND) for r in range(t.ranks)]
            u[name] = _average(local, t.worker[name], t.server[name], torch.where(t.v[name] != 0, 1.0, 1e-8))
            t.p[name] = [t.p[name][0] * (1 - lr * wd) - lr * u[name]] * t.ranks
    return {n: ranks[0] for n, ranks in t.p.items()}


def _zero_one_adam(initial: dict, records: list[list[dict]], var_freeze: int, var_scaler: int, local_scaler: int,
                   clipper: int) -> list[dict]:
    """Lu et al.: the variance only on full-precision steps, at intervals doubling after every
    var_scaler of them, a compressed gradient on the others; after var_freeze, local steps whose
    learning-rate-weighted momentum is averaged (compressed) every interval steps. Per rank."""
    t = _Transcription(initial, len(records))
    u = {n: [torch.zeros_like(w) for _ in range(t.ranks)] for n, w in initial.items()}
    var_interval, var_counter, interval, counter, lrs = 1, 0, 1, 0, 0.0
    for step, per_rank in enumerate(zip(*records), start=1):
        lr = per_rank[0][next(iter(initial))][1]
        if step - 1 <= var_freeze:
            full = step % var_interval == 0
            for name in initial:
                g, lr, wd = per_rank[0][name]
                if full:
                    t.adam(name, g, lr, wd)
                else:
                    grads = [per_rank[r][name][0] for r in range(t.ranks)]
                    averaged = _average(grads, t.worker[name], t.server[name], t.v[name].sqrt() + 1e-8,
                                        GRADIENT_BOUND)
                    m = t.m[name][0].lerp(averaged, 1 - BETAS[0])
                    t.frozen_adam(name, m, lr, wd)
            if full:
                var_counter += 1
                if var_counter == var_scaler:
                    var_counter, var_interval = 0, 2 * var_interval
            if step > var_freeze:
                for name in initial:
                    t.worker[name] = [torch.zeros_like(e) for e in t.worker[name]]
                    t.server[name].zero_()
            continue
        lrs += lr
        for name in initial:
            denom = t.v[name].sqrt() + 1e-8
            for r in range(t.ranks):
                g, lr, wd = per_rank[r][name]
                t.m[name][r] = t.m[name][r].lerp(g, 1 - BETAS[0])
                move = (t.m[name][r] / denom).clamp(-MOMENTUM_BOUND, MOMENTUM_BOUND) + wd * t.p[name][r]
                t.p[name][r] = t.p[name][r] - lr * move
                u[name][r] = u[name][r] - lr * move
        if step % interval == 0:
            for name in initial:
                # the moves are preconditioned already: averaged as they are
                live = t.v[name] != 0
                ones = torch.where(live, 1.0, 1e-8)
                averaged = _average(u[name], t.worker[name], t.server[name], ones)
                for r in range(t.ranks):
                    t.p[name][r] = t.p[name][r] - u[name][r] + averaged
                    t.m[name][r] = averaged * (t.v[name].sqrt() + 1e-8) / -lrs
                u[name] = [torch.zeros_like(x) for x in u[name]]
            lrs = 0.0
        counter += 1
        if counter == local_scaler:
            counter, interval = 0, min(clipper, 2 * interval)
    return [{n: ranks[r] for n, ranks in t.p.items()} for r in range(t.ranks)]


def _one_bit_lamb(initial: dict, records: list[list[dict]], freeze: int) -> dict:
    """Li et al.: LAMB for `freeze` steps, keeping a moving average (0.9) of each tensor's trust
    ratio; then compressed momenta, a fresh variance from them, and the frozen trust ratio times a
    factor clamped to [0.5, 4] and to 10% change per step."""
    t = _Transcription(initial, len(records))
    coeff = {n: 0.0 for n in initial}
    last = {n: 1.0 for n in initial}
    fresh = {}
    for step, per_rank in enumerate(zip(*records), start=1):
        for name in initial:
            g, lr, wd = per_rank[0][name]
            p, v = t.p[name][0], t.v[name]
            if step <= freeze:
                m = t.m[name][0] * BETAS[0] + (1 - BETAS[0]) * g
                v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
                update = m / (v.sqrt() + 1e-8) + wd * p
                w_norm, u_norm = p.norm().item(), update.norm().item()
                trust = min(max(w_norm / u_norm, 0.01), 10.0) if w_norm > 0 and u_norm > 0 else 1.0
                if trust != 1.0:
                    coeff[name] = 0.9 * coeff[name] + 0.1 * trust
                if step == freeze:
                    fresh[name] = v.clone()
                p = p - lr * trust * update
            else:
                previous = t.m[name][0]
                local = [previous * BETAS[0] + (1 - BETAS[0]) * per_rank[r][name][0] for r in range(t.ranks)]
                m = _average(local, t.worker[name], t.server[name], v.sqrt() + 1e-8, MOMENTUM_BOUND)
                recovered = (m - BETAS[0] * previous) / (1 - BETAS[0])
                fresh[name].mul_(BETAS[1]).addcmul_(recovered, recovered, value=1 - BETAS[1])
                denom = v.sqrt() + 1e-8
                before_decay = m / denom
                update = before_decay + wd * p
                factor = (denom / (fresh[name].sqrt() + 1e-8)).max().item()
                if wd > 0:
                    ratio = min(1.0, before_decay.norm().item() / update.norm().item())
                    factor = factor * ratio + (1 - ratio)
                factor = min(max(factor, 0.5), 4.0)
                factor = min(max(factor, last[name] * 0.9), last[name] * 1.1)
                last[name] = factor
                p = p - lr * coeff[name] * factor * update
            t.m[name] = [m.clone() for _ in range(t.ranks)]
            t.p[name] = [p.clone() for _ in range(t.ranks)]
    return {n: ranks[0] for n, ranks in t.p.items()}


def _assert_close(expected: dict, got: dict, what: str) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=2e-6, msg=lambda m, n=name: f"{what} {n}: {m}")


@pytest.mark.parametrize("optimizer", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_compressed_stage_equals_the_papers_update(pools, token_dataset_prefix_module, optimizer):
    params = COMPRESSED[optimizer]
    # vocabulary 251 in 256 rows: 5 padded rows never get a gradient, and are left out of the compression
    results = pools(2).run(_train, _config(optimizer, params), token_dataset_prefix_module, STEPS, True, PADDED)
    assert results[0]["excluded"] == 5 * 64
    records, initial = results[0]["records"], results[0]["initial"]
    if optimizer == "OneBitAdam":
        expected = [_one_bit_adam(initial, records, params["freeze_step"])] * 2
    elif optimizer == "OneBitLamb":
        expected = [_one_bit_lamb(initial, records, params["freeze_step"])] * 2
    else:
        expected = _zero_one_adam(initial, records, params["var_freeze_step"], params["var_update_scaler"],
                                  params["local_step_scaler"], params["local_step_clipper"])
    for rank, result in enumerate(results):
        _assert_close(expected[rank], result["params"], f"{optimizer} rank {rank}")
    # the compressed stage's steps are not Adam's/LAMB's: the transcription is not vacuous
    plain = pools(2).run(_train, _config(PLAIN[optimizer], {"bias_correction": False}), token_dataset_prefix_module,
                         STEPS, False, PADDED)
    assert any(not torch.allclose(plain[0]["params"][n], results[0]["params"][n], rtol=1e-3, atol=1e-5)
               for n in initial)


# a checkpoint in the compressed stage; 0/1 Adam: local steps from step 5, synchronised at steps 5,
# 6 and 8 (intervals 1, 2, 4), so step 7's checkpoint holds each rank's own weights
RESUMED = {"OneBitAdam": {"freeze_step": 3}, "OneBitLamb": {"freeze_step": 3},
           "ZeroOneAdam": {"var_freeze_step": 3, "var_update_scaler": 2, "local_step_scaler": 1,
                           "local_step_clipper": 4}}


@pytest.mark.parametrize("optimizer", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_a_checkpoint_in_the_compressed_stage_resumes_bit_for_bit(pools, token_dataset_prefix_module, tmp_path,
                                                                  optimizer):
    config = _config(optimizer, RESUMED[optimizer])
    save = str(tmp_path / "ckpt")
    straight = pools(2).run(train, config, token_dataset_prefix_module, STEPS, 0, save, 7)
    resumed = pools(2).run(train, config, token_dataset_prefix_module, STEPS, 0, None, None, save)
    for a, b in zip(straight, resumed):
        assert a["losses"][7:] == b["losses"]
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    assert sorted(p.name for p in (tmp_path / "ckpt" / "global_step7").glob("optim_rank_state_rank*.pt")) == \
        ["optim_rank_state_rank0.pt", "optim_rank_state_rank1.pt"]
    if optimizer == "ZeroOneAdam":  # between synchronisations the ranks' weights differ, and resume so
        assert any(not torch.equal(straight[0]["params"][n], straight[1]["params"][n]) for n in straight[0]["params"])


def _refusal(config: dict, prefix: str) -> str:
    try:
        build_engine(config, prefix)
    except ConfigError as e:
        return str(e)
    return "built"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_are_refused_saying_why(pools, token_dataset_prefix_module, stage):
    config = _config("OneBitAdam", {"freeze_step": 3}, zero_optimization={"stage": stage})
    for message in pools(2).run(_refusal, config, token_dataset_prefix_module):
        assert f"optimizer OneBitAdam with zero_optimization.stage {stage}" in message
        assert "use stage 0" in message


def _train_16bit(config: dict, prefix: str) -> dict:
    engine, loader = build_engine(config, prefix)
    data = iter(loader)
    losses = [global_mean(engine.train_batch(data).item(), engine) for _ in range(12)]
    return {"losses": losses, "skipped": engine.skipped_steps}


@pytest.mark.parametrize("optimizer", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_fp16_and_bf16_track_fp32(pools, token_dataset_prefix_module, optimizer):
    """The compressed stage takes the engine's unscaled, clipped gradients: fp16 (loss scale 2^16)
    and bf16 stay within 2% of fp32's losses; skipped steps agree across ranks."""
    fp32 = pools(2).run(_train_16bit, _config(optimizer, COMPRESSED[optimizer]), token_dataset_prefix_module)[0]
    for half in ({"fp16": {"enabled": True, "initial_scale_power": 16}}, {"bf16": {"enabled": True}}):
        results = pools(2).run(_train_16bit, _config(optimizer, COMPRESSED[optimizer], **half),
                               token_dataset_prefix_module)
        assert results[0]["skipped"] == results[1]["skipped"] == 0
        for a, b in zip(fp32["losses"], results[0]["losses"]):
            assert abs(a - b) <= 0.02 * a, (list(half), fp32["losses"], results[0]["losses"])


def test_an_overflow_on_one_rank_skips_the_step_on_both(pools, token_dataset_prefix_module):
    """fp16 in the compressed stage: gradients are each rank's own, so an inf on rank 1 alone must
    still skip the step (and halve the loss scale) on rank 0."""
    for result in pools(2).run(_overflow_on_rank_1, token_dataset_prefix_module):
        assert result == {"skipped": 1, "scale": 2.0 ** 15}


def _overflow_on_rank_1(prefix: str) -> dict:
    config = _config("OneBitAdam", COMPRESSED["OneBitAdam"],
                     fp16={"enabled": True, "initial_scale_power": 16, "hysteresis": 1})
    engine, loader = build_engine(config, prefix)
    data = iter(loader)
    for step in range(6):
        if step == 4 and dist.get_rank() == 1:  # a compressed step: rank 1's gradients overflow
            batch = engine.to_device(next(data))
            loss = engine(**batch) * float("inf")
            engine.backward(loss)
            engine.step()
        else:
            engine.train_batch(data)
    return {"skipped": engine.skipped_steps, "scale": engine.get_loss_scale()}


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)])
def test_tensor_and_pipeline_parallel_replicas_stay_identical(pools, token_dataset_prefix_module, layout):
    """TP=2 or PP=2 x DP=2 (4 ranks): the warm-up equals Adam at that layout bit for bit, and after
    it the two data-parallel replicas hold the same weights (every rank decodes the same average)."""
    plain = pools(4).run(train, _config("Adam", {"bias_correction": False}), token_dataset_prefix_module, 3, 0,
                         None, None, None, None, layout)
    onebit = pools(4).run(train, _config("OneBitAdam", {"freeze_step": 3}), token_dataset_prefix_module, STEPS, 0,
                          None, None, None, None, layout)
    assert onebit[0]["losses"][:3] == plain[0]["losses"]
    first, other = onebit[0]["params"], onebit[2]["params"]  # data-parallel ranks 0 and 1 (TP/PP innermost)
    assert all(torch.equal(first[n], other[n]) for n in first)
    assert onebit[0]["losses"][-1] < onebit[0]["losses"][0] - 0.3
