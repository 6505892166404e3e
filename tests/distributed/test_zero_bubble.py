"""The zero-bubble H1 schedule (`pipeline.schedule: zb-h1`: backward split into B and W, the W's in
1F1B's bubbles) trains as the single process: PP=2 at ZeRO 0, 1 (with full recomputation) and 2 (the
GPT; the Llama at ZeRO-0), TP=2 + SP x PP=2 (4 ranks), dropout 0.1 on layout-invariant masks, 10 steps
of 4 micro-batches; losses within 1e-5 relative, weights within 2e-5; weight gradients were deferred
to W's. Virtual stages are refused by name."""

from __future__ import annotations

import pytest

from tests.distributed.test_layout_invariant_dropout import INVARIANT, MODEL, _assert_matches
from tests.training_helpers import FAMILY, base_config, build_engine, full_parameters, global_mean, train

STEPS = 10


def _config(schedule: str, stage: int = 0) -> dict:
    return base_config(train_micro_batch_size_per_gpu=2, pipeline={"schedule": schedule},
                       zero_optimization={"stage": stage, "reduce_bucket_size": 20000}, **INVARIANT)


@pytest.fixture(scope="module")
def references(pools, token_dataset_prefix_module):
    """The single process, 4 micro-batches of 2 (the pipeline's), per model family."""
    return {family: pools(1).run(train, _config("1f1b"), token_dataset_prefix_module, STEPS, 0, None, None,
                                 None, {**MODEL, FAMILY: family})[0] for family in ("gpt", "llama")}


def run_pipeline(config: dict, prefix: str, model: dict, layout: tuple[int, int]) -> dict:
    """train() with the weight-gradient jobs the W actions ran (0 if nothing was deferred)."""
    engine, loader = build_engine(config, prefix, 0, model, layout)
    data = iter(loader)
    losses = [global_mean(engine.train_batch(data).item(), engine) for _ in range(STEPS)]
    return {"losses": losses, "params": full_parameters(engine), "weight_jobs": engine.pipeline.weight_jobs}


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_zb_h1_matches_single_process_and_1f1b(pools, references, token_dataset_prefix_module, family):
    model = {**MODEL, FAMILY: family}
    # ZeRO-1 with full recomputation: the B recomputes, its W keeps what it made (the Llama: ZeRO-0 alone)
    for stage in (0, 1, 2) if family == "gpt" else (0,):
        overrides = {**model, "recompute_granularity": "full"} if stage == 1 else model
        for rank, result in enumerate(pools(2).run(run_pipeline, _config("zb-h1", stage),
                                                   token_dataset_prefix_module, overrides, (1, 2))):
            _assert_matches(references[family], result, f"{family} PP=2 zb-h1 ZeRO-{stage} rank {rank}")
            assert result["weight_jobs"] > 0, f"{family} rank {rank}: no weight gradient was deferred to a W"
    overrides = {**model, "sequence_parallel": True}
    for rank, result in enumerate(pools(4).run(run_pipeline, _config("zb-h1"), token_dataset_prefix_module,
                                               overrides, (2, 2))):
        _assert_matches(references[family], result, f"{family} TP=2 + SP x PP=2 zb-h1 rank {rank}")
        assert result["weight_jobs"] > 0


def refusal(prefix: str) -> str:
    """The message of zb-h1 with virtual stages (the recipes print it)."""
    from megazero.config import ConfigError
    from tests.training_helpers import LAYERS_PER_VIRTUAL_STAGE

    config = {**_config("zb-h1"), "pipeline": {"schedule": "zb-h1", "num_layers_per_virtual_stage": 1}}
    try:
        build_engine(config, prefix, 0, {**MODEL, LAYERS_PER_VIRTUAL_STAGE: 1}, (1, 2))
    except ConfigError as e:
        return str(e)
    return "accepted"


def test_zb_h1_refuses_virtual_stages(pools, token_dataset_prefix_module):
    assert "pipeline.schedule zb-h1 runs one model chunk per stage" in pools(2).run(refusal,
                                                                                  token_dataset_prefix_module)[0]


def test_a_zb_h1_checkpoint_continues_under_1f1b(pools, token_dataset_prefix_module, tmp_path):
    """Checkpoints do not depend on the schedule: saved at step 3 of a zb-h1 run, loaded under 1f1b,
    the next 3 steps are the zb-h1 run's."""
    save = str(tmp_path / "ckpt")
    zb = pools(2).run(train, _config("zb-h1"), token_dataset_prefix_module, 6, 0, save, 3, None, MODEL, (1, 2))
    later = pools(2).run(train, _config("1f1b"), token_dataset_prefix_module, 6, 0, None, None, save, MODEL, (1, 2))
    for rank, (a, b) in enumerate(zip(zb, later)):
        assert b["losses"] == pytest.approx(a["losses"][3:], rel=1e-5), f"rank {rank}"
