"""Steps skipped for inf/nan gradients under fp32 and bf16 are reported, never silent: the engine
prints each one, and the recipe's console line and TensorBoard count them per log interval
(Megatron's "number of skipped iterations" / "number of nan iterations"), read back from the
event file. Under fp16 with dynamic loss scaling an overflow is a skipped step but not a nan one."""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.training_helpers import TINY, base_config, build_engine

POISONED = (1, 4)  # micro-steps whose loss is multiplied by nan: iterations 2 and 5
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
              "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}}}


def _poisoned_run(prefix: str, tb_dir: str, precision: str) -> dict:
    from megazero.config.run import ScheduleSection
    from megazero.training import ProgressLog

    config = base_config(tensorboard={"enabled": True, "output_path": tb_dir, "job_name": "run"},
                         **PRECISIONS[precision])
    engine, loader = build_engine(config, prefix)
    schedule = ScheduleSection(log_interval=2, train_iters=6)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        log = ProgressLog(engine, schedule, TINY["seq_length"], 1.0, 1.0, engine.global_rank)
        data = iter(loader)
        for step in range(6):
            loss = engine(**next(data))
            engine.backward(loss * float("nan") if step in POISONED else loss)
            engine.step()
            log.record(loss.item())
    engine.monitor.close()
    return {"out": out.getvalue(), "skipped": engine.skipped_steps, "nan": engine.nan_steps}


def _scalars(log_dir: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nan_steps_are_printed_and_logged(pools, token_dataset_prefix, tmp_path, precision):
    result = pools(1).run(_poisoned_run, token_dataset_prefix, str(tmp_path), precision)[0]
    assert result["skipped"] == result["nan"] == 2
    lines = [line for line in result["out"].splitlines() if line.startswith(" iteration")]
    assert [("number of nan iterations:   1" in line, "number of skipped iterations:   1" in line)
            for line in lines] == [(True, True), (False, False), (True, True)]
    assert result["out"].count("skipped: the gradient norm is nan under ") == 2
    per_window = [(2, 1.0), (4, 0.0), (6, 1.0)]
    assert _scalars(str(tmp_path / "run"), "nan-iterations") == per_window
    assert _scalars(str(tmp_path / "run"), "skipped-iterations") == per_window


def test_fp16_overflow_is_skipped_but_not_nan(pools, token_dataset_prefix, tmp_path):
    result = pools(1).run(_poisoned_run, token_dataset_prefix, str(tmp_path), "fp16")[0]
    assert result["skipped"] == 2 and result["nan"] == 0
    assert _scalars(str(tmp_path / "run"), "nan-iterations") == [(2, 0.0), (4, 0.0), (6, 0.0)]
    assert _scalars(str(tmp_path / "run"), "skipped-iterations") == [(2, 1.0), (4, 0.0), (6, 1.0)]


def _nan_count_across_a_resume(prefix: str, save_dir: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        engine, loader = build_engine(base_config(), prefix)
        data = iter(loader)
        for step in range(3):
            loss = engine(**next(data))
            engine.backward(loss * float("nan") if step == 1 else loss)
            engine.step()
        engine.save_checkpoint(save_dir)
        resumed, loader = build_engine(base_config(), prefix)
        resumed.load_checkpoint(save_dir)
        counts = {"loaded": (resumed.global_steps, resumed.skipped_steps, resumed.nan_steps)}
        loss = resumed(**next(iter(loader)))
        resumed.backward(loss * float("nan"))
        resumed.step()
    return {**counts, "after": (resumed.global_steps, resumed.skipped_steps, resumed.nan_steps), "out": out.getvalue()}


def test_a_resumed_run_keeps_counting_nan_steps(pools, token_dataset_prefix, tmp_path):
    result = pools(1).run(_nan_count_across_a_resume, token_dataset_prefix, str(tmp_path / "ckpt"))[0]
    assert result["loaded"] == (3, 1, 1)
    assert result["after"] == (4, 2, 2)
    assert "step 4 skipped: the gradient norm is nan under float32 without dynamic loss scaling (2 such steps so " \
           "far)" in result["out"]
