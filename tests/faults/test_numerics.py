"""Runaway numerics stop cleanly (issue 14, item 5): real engine runs with injected faults.

Faults: a gradient hook that writes nan into one parameter's gradient; a forward hook that makes
the model's loss inf (with finite gradients: only the engine's check before backward can catch
it) or nan. After max_consecutive_skipped_steps skipped steps in a row the engine raises
NumericsError on every rank with one message (step, loss scale, first parameter with a non-finite
gradient, ranks whose loss was non-finite), and the weights are those before the bad steps.
"""

from __future__ import annotations

import time

import pytest
import torch

from megazero.config import ConfigError, parse_config
from megazero.numerics import NumericsError
from tests.training_helpers import base_config, build_engine, full_parameters

PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
              "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}}}
HOOKED = "blocks.1.attn.proj.weight"  # the parameter whose gradient the "grad" fault poisons
NUM_PARAMS = 28  # of the tiny GPT


def _global_names(engine) -> dict[str, torch.nn.Parameter]:
    rename = getattr(engine.module, "global_parameter_name", lambda name: name)
    return {rename(name): p for name, p in engine.module.named_parameters()}


class _Fault:
    """Installs one fault on this rank for the bad steps: 'grad' (nan into HOOKED's gradient),
    'loss_inf' (loss + inf: finite gradients) or 'loss_nan' (loss * nan), the loss faults on
    micro-batch `micro` of each bad step only."""

    def __init__(self, engine, kind: str, micro: int):
        self.engine, self.kind, self.micro, self.handle, self.calls = engine, kind, micro, None, 0

    def _poison_loss(self, module, args, output):
        self.calls += 1
        if not module.training or self.calls - 1 != self.micro:
            return output
        return output + float("inf") if self.kind == "loss_inf" else output * float("nan")

    def arm(self) -> None:
        self.calls = 0
        if self.handle is not None:
            return
        if self.kind == "grad":
            param = _global_names(self.engine).get(HOOKED)
            if param is not None:  # (a pipeline stage without it has nothing to poison)
                self.handle = param.register_hook(lambda grad: torch.full_like(grad, float("nan")))
        elif self.engine.grid is None or self.engine.grid.is_last_stage:  # the model's output is the loss
            self.handle = self.engine.module.register_forward_hook(self._poison_loss)

    def disarm(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def _run(prefix: str, precision: str, kind: str, bad_steps: list[int], limit: int, fault_ranks=(0,),
         zero_stage: int = 0, layout=None, accumulation: int = 1, micro: int = 0, max_steps: int = 12,
         fp16_overrides: dict | None = None) -> dict:
    """Train until NumericsError (or max_steps) with the fault on `fault_ranks` in `bad_steps`."""
    overrides = dict(PRECISIONS[precision])
    if fp16_overrides:
        overrides["fp16"] = {**overrides["fp16"], **fp16_overrides}
    config = base_config(max_consecutive_skipped_steps=limit, gradient_accumulation_steps=accumulation,
                         zero_optimization={"stage": zero_stage, "reduce_bucket_size": 20000}, **overrides)
    config.pop("scheduler")  # a constant lr: the warmup's first steps have lr 0 and would not move the weights
    engine, loader = build_engine(config, prefix, layout=layout)
    fault = _Fault(engine, kind, micro)
    data = iter(loader)
    weights, scales, error, fault_at, elapsed = {}, [], None, None, None
    try:
        while engine.global_steps < max_steps:
            step = engine.global_steps + 1
            weights[step] = full_parameters(engine)
            scales.append(engine.get_loss_scale())
            if step in bad_steps and engine.global_rank in fault_ranks:
                fault.arm()
            else:
                fault.disarm()
            if step in bad_steps and fault_at is None:
                fault_at = time.perf_counter()
            engine.train_batch(data)
    except NumericsError as e:
        error, elapsed = str(e), time.perf_counter() - fault_at
    fault.disarm()
    stop = engine.global_steps
    first_bad = min(s for s in bad_steps if all(t in bad_steps for t in range(s, stop + 1))) if error else None
    after = full_parameters(engine)
    reference = weights[first_bad] if error else weights[min(bad_steps)]
    return {"error": error, "stop": stop, "elapsed": elapsed, "scale": scales[-1], "skipped": engine.skipped_steps,
            "unchanged": all(torch.equal(after[n], reference[n]) for n in reference),
            "trained_before": any(not torch.equal(weights[1][n], reference[n]) for n in reference)}


def _run_kw(kwargs: dict) -> dict:
    """_run(**kwargs), for the pools (which pass positional arguments)."""
    return _run(**kwargs)


def _message(step: int, count: int, limit: int) -> str:
    steps = f"steps {step - count + 1}-{step}" if count > 1 else f"step {step}"
    return (f"step {step}: {count} consecutive optimizer steps skipped ({steps}; "
            f"max_consecutive_skipped_steps = {limit})")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_nan_gradient_stops_at_the_limit_with_weights_untouched(pools, token_dataset_prefix, precision):
    result = pools(1).run(_run, token_dataset_prefix, precision, "grad", list(range(3, 20)), 3)[0]
    assert result["stop"] == 5 and result["skipped"] == 3, result
    message = result["error"]
    assert _message(5, 3, 3) in message
    assert f"first parameter with a non-finite gradient: {HOOKED} (1 of {NUM_PARAMS} parameters have one)" in message
    kind = {"fp32": "1, float32 (no loss scaling)", "bf16": "1, bfloat16 (no loss scaling)",
            "fp16": f"{result['scale']:g}, fp16 dynamic"}[precision]
    assert f"; loss scale {kind};" in message, message
    assert "The weights are those after step 2" in message and "forward loss" not in message
    assert result["unchanged"] and result["trained_before"]


def test_fp16_loss_scale_collapse_is_named(pools, token_dataset_prefix):
    # scale 2 -> (hysteresis) 2 -> 1 -> 1 -> 1: stopped at the 5th skip, at min_loss_scale
    result = pools(1).run(_run_kw, dict(prefix=token_dataset_prefix, precision="fp16", kind="grad",
                                         bad_steps=list(range(2, 20)), limit=5,
                                         fp16_overrides={"initial_scale_power": 1}))[0]
    assert result["stop"] == 6 and _message(6, 5, 5) in result["error"]
    assert "loss scale 1, fp16 dynamic (at min_loss_scale: a loss-scale collapse)" in result["error"]
    assert result["unchanged"]


def test_an_applied_step_resets_the_count_and_zero_never_stops(pools, token_dataset_prefix):
    pool = pools(1)
    result = pool.run(_run, token_dataset_prefix, "fp32", "grad", [2, 3, 5, 6, 7, 8], 3)[0]
    assert result["stop"] == 7 and _message(7, 3, 3) in result["error"]  # 2-3 then 4 applied: not at 5
    assert result["unchanged"] and result["skipped"] == 5
    result = pool.run(_run_kw, dict(prefix=token_dataset_prefix, precision="fp32", kind="grad",
                                    bad_steps=list(range(2, 9)), limit=0, max_steps=8))[0]
    assert result["error"] is None and result["stop"] == 8 and result["skipped"] == 7 and result["unchanged"]


def test_inf_loss_with_finite_gradients_is_caught_before_backward(pools, token_dataset_prefix):
    """loss + inf has the loss's gradients (finite): without the check before backward the engine
    would step on it. Micro-batch 1 of 2 is poisoned; the message says so."""
    result = pools(1).run(_run_kw, dict(prefix=token_dataset_prefix, precision="fp32", kind="loss_inf",
                                         bad_steps=[3, 4], limit=2, accumulation=2, micro=1))[0]
    assert result["stop"] == 4 and _message(4, 2, 2) in result["error"], result
    assert "the forward loss was already inf/nan (found before backward) on rank 0 micro-batch 1" in result["error"]
    assert f"first parameter with a non-finite gradient: wte.weight ({NUM_PARAMS} of {NUM_PARAMS}" in result["error"]
    assert result["unchanged"]


@pytest.mark.parametrize("precision,stage", [("fp16", 2), ("bf16", 0)])
def test_two_ranks_stop_together_on_one_rank_fault(pools, token_dataset_prefix, precision, stage):
    results = pools(2).run(_run, token_dataset_prefix, precision, "grad", list(range(3, 20)), 3, (1,), stage)
    assert [r["stop"] for r in results] == [5, 5]
    assert results[0]["error"] == results[1]["error"] and _message(5, 3, 3) in results[0]["error"]
    assert f"first parameter with a non-finite gradient: {HOOKED}" in results[0]["error"]
    assert all(r["unchanged"] for r in results)


def test_two_ranks_nan_loss_on_one_rank(pools, token_dataset_prefix):
    results = pools(2).run(_run, token_dataset_prefix, "fp32", "loss_nan", [2, 3], 2, (1,))
    assert [r["stop"] for r in results] == [3, 3]
    assert results[0]["error"] == results[1]["error"]
    assert "found before backward) on rank 1 micro-batch 0." in results[0]["error"]
    assert all(r["unchanged"] for r in results)


def test_pipeline_names_the_parameter_globally(pools, token_dataset_prefix):
    """2 pipeline stages: HOOKED is blocks.0 of the last stage; the message uses its global name,
    on both stages."""
    results = pools(2).run(_run_kw, dict(prefix=token_dataset_prefix, precision="fp32", kind="grad",
                                         bad_steps=list(range(2, 20)), limit=2, fault_ranks=(0, 1), layout=(1, 2),
                                         accumulation=2))
    assert [r["stop"] for r in results] == [3, 3]
    assert results[0]["error"] == results[1]["error"]
    assert f"first parameter with a non-finite gradient: {HOOKED} (1 of {NUM_PARAMS}" in results[0]["error"]
    assert all(r["unchanged"] for r in results)
    # the last stage's loss (inf, finite gradients) is checked before its backward too
    results = pools(2).run(_run_kw, dict(prefix=token_dataset_prefix, precision="fp32", kind="loss_inf",
                                         bad_steps=[2, 3], limit=2, fault_ranks=(1,), layout=(1, 2),
                                         accumulation=2, micro=1))
    assert [r["stop"] for r in results] == [3, 3] and results[0]["error"] == results[1]["error"]
    assert "(found before backward) on rank 1 micro-batch 1." in results[0]["error"]
    assert all(r["unchanged"] for r in results)


def test_config_key():
    base = {"train_batch_size": 8}
    assert parse_config(base, 1).max_consecutive_skipped_steps == 100
    assert parse_config({**base, "max_consecutive_skipped_steps": 0}, 1).max_consecutive_skipped_steps == 0
    with pytest.raises(ConfigError, match="'max_consecutive_skipped_steps' must be >= 0"):
        parse_config({**base, "max_consecutive_skipped_steps": -1}, 1)
