"""The zero-bubble schedules (`pipeline.schedule`: backward split into B and W) train as the single
process, dropout 0.1 on layout-invariant masks, 10 steps of 4 micro-batches, losses within 1e-5
relative and weights within 2e-5, with weight gradients deferred to W's:
- zb-h1 (1F1B's order, the W's in its bubbles): PP=2 at ZeRO 1 (full recomputation) and 2 (the
  GPT; the Llama at ZeRO-0); virtual stages are refused by name;
- zbv (two chunks per stage in a V): PP=2 at ZeRO-1 (its checkpoint continues under 1f1b), TP=2 +
  SP x PP=2 at ZeRO-2 with full recomputation, a MoE GPT, and PP=4 in strict p2p mode (the order
  NCCL needs); in bf16 and fp16 its losses are 1F1B's (1e-3);
- a new generator (GPipe's order with split backwards) runs on the action runner as well."""

from __future__ import annotations

import pytest
import torch

from megazero import parallel_state
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
    # ZeRO-1 with full recomputation: the B recomputes, its W keeps what it made (the Llama: ZeRO-0 alone;
    # TP + SP, whose linear layers split the same way, are zbv's test's)
    for stage in (1, 2) if family == "gpt" else (0,):
        overrides = {**model, "recompute_granularity": "full"} if stage == 1 else model
        for rank, result in enumerate(pools(2).run(run_pipeline, _config("zb-h1", stage),
                                                   token_dataset_prefix_module, overrides, (1, 2))):
            _assert_matches(references[family], result, f"{family} PP=2 zb-h1 ZeRO-{stage} rank {rank}")
            assert result["weight_jobs"] > 0, f"{family} rank {rank}: no weight gradient was deferred to a W"


def test_zbv_matches_single_process_and_continues_under_1f1b(pools, references, token_dataset_prefix_module,
                                                             tmp_path):
    """zbv (two chunks per stage in a V, rank 0 holding the embedding and the tied output layer) at
    PP=2, ZeRO-1, 4 micro-batches (its minimum, 2 x PP); its checkpoint saved at step 5 continues
    under 1f1b (the chunks' layers converted to the stages') as the zbv run does, and a 1f1b
    checkpoint of step 5 continues under zbv likewise."""
    save = str(tmp_path / "ckpt")
    zbv = pools(2).run(train, _config("zbv", 1), token_dataset_prefix_module, STEPS, 0, save, 5, None, MODEL,
                       (1, 2))
    for rank, result in enumerate(zbv):
        _assert_matches(references["gpt"], result, f"gpt PP=2 zbv ZeRO-1 rank {rank}")
    later = pools(2).run(train, _config("1f1b", 1), token_dataset_prefix_module, STEPS, 0, None, None, save, MODEL,
                         (1, 2))
    for rank, (a, b) in enumerate(zip(zbv, later)):
        assert b["losses"] == pytest.approx(a["losses"][5:], rel=1e-5), f"rank {rank}"
    # and back: a 1F1B run's checkpoint (the last stage holding the output layer's copy) continues under zbv
    back = str(tmp_path / "ckpt_1f1b")
    pools(2).run(train, _config("1f1b", 1), token_dataset_prefix_module, 5, 0, back, 5, None, MODEL, (1, 2))
    resumed = pools(2).run(train, _config("zbv", 1), token_dataset_prefix_module, STEPS, 0, None, None, back, MODEL,
                           (1, 2))
    for rank, (a, b) in enumerate(zip(zbv, resumed)):
        assert b["losses"] == pytest.approx(a["losses"][5:], rel=1e-5), f"rank {rank}: 1f1b -> zbv"


def test_zbv_with_tp_sp_recompute_zero2_and_with_moe_matches_single_process(pools, references,
                                                                            token_dataset_prefix_module):
    """zbv at TP=2 + SP x PP=2 (4 ranks), ZeRO-2, full recomputation; and a GPT with 4 experts per
    MoE layer at PP=2 (its auxiliary losses from both chunks), each as its single process."""
    overrides = {**MODEL, "sequence_parallel": True, "recompute_granularity": "full"}
    for rank, result in enumerate(pools(4).run(run_pipeline, _config("zbv", 2), token_dataset_prefix_module,
                                               overrides, (2, 2))):
        _assert_matches(references["gpt"], result, f"gpt TP=2 + SP x PP=2 zbv ZeRO-2 rank {rank}")
        assert result["weight_jobs"] > 0
    moe = {**MODEL, "num_experts": 4}
    one = pools(1).run(train, _config("1f1b"), token_dataset_prefix_module, STEPS, 0, None, None, None, moe)[0]
    for rank, result in enumerate(pools(2).run(run_pipeline, _config("zbv", 1), token_dataset_prefix_module, moe,
                                               (1, 2))):
        _assert_matches(one, result, f"MoE gpt PP=2 zbv rank {rank}")


def gpipe_split(p: int, m: int):
    """A schedule no runner was written for: every forward, then every backward, each W right after
    its B (GPipe's order)."""
    from megazero.pipeline.actions import LOOP, Action, B, F, Schedule, W

    order = [Action(F, 0, i) for i in range(m)] + [a for i in range(m) for a in (Action(B, 0, i), Action(W, 0, i))]
    return Schedule("gpipe", p, m, 1, LOOP, [list(order) for _ in range(p)])


def with_new_generator(config: dict, prefix: str, model: dict) -> dict:
    """run_pipeline with gpipe_split generating the schedule the config names."""
    from megazero.pipeline import actions

    actions.SCHEDULES[config["pipeline"]["schedule"]] = gpipe_split
    try:
        return run_pipeline(config, prefix, model, (1, 2))
    finally:
        actions.SCHEDULES[config["pipeline"]["schedule"]] = actions.zero_bubble_h1


def test_a_new_schedule_is_a_generator_function(pools, references, token_dataset_prefix_module):
    """A generator whose order is neither 1F1B's nor a V runs on the action runner, as the single process."""
    for rank, result in enumerate(pools(2).run(with_new_generator, _config("zb-h1"), token_dataset_prefix_module,
                                               MODEL)):
        _assert_matches(references["gpt"], result, f"gpipe order with split backward, rank {rank}")
        assert result["weight_jobs"] > 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zbv_in_low_precision_equals_1f1b(pools, token_dataset_prefix_module, precision):
    """bf16, and fp16 with its dynamic loss scale: zbv's losses are 1F1B's at PP=2 (the W's gradients
    unscaled and clipped with the B's), with the same steps skipped."""
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {"fp16": {"enabled": True,
                                                                            "initial_scale_power": 12}}
    runs = {schedule: pools(2).run(train, {**_config(schedule, 1), **extra}, token_dataset_prefix_module, 5, 0, None,
                                   None, None, MODEL, (1, 2))[0] for schedule in ("1f1b", "zbv")}
    assert runs["zbv"]["losses"] == pytest.approx(runs["1f1b"]["losses"], rel=1e-3)
    assert runs["zbv"]["skipped"] == runs["1f1b"]["skipped"]


def strict_zbv(config: dict, prefix: str, model: dict) -> dict:
    """train() at PP=4 in strict p2p mode (each send waits for the peer's receive: NCCL's order)."""
    from megazero.pipeline.p2p import set_strict

    set_strict(True)
    try:
        return train(config, prefix, 3, 0, None, None, None, model, (1, 4))
    finally:
        set_strict(None)


def test_zbv_at_four_stages_in_strict_p2p_matches_single_process(pools, token_dataset_prefix_module):
    """zbv at PP=4 (8 micro-batches, 8 parts of 8 layers): the middle ranks pass activations both
    ways, and each rank receives a peer's messages in the peer's order, which strict mode checks."""
    model = {**MODEL, "num_layers": 8}
    config = {**_config("zbv"), "train_batch_size": 16}
    one = pools(1).run(train, _config("1f1b") | {"train_batch_size": 16}, token_dataset_prefix_module, 3, 0, None,
                       None, None, model)[0]
    for rank, result in enumerate(pools(4).run(strict_zbv, config, token_dataset_prefix_module, model)):
        assert result["losses"] == pytest.approx(one["losses"], rel=1e-5), f"rank {rank}"
        for name, value in one["params"].items():
            assert torch.allclose(result["params"][name], value, atol=2e-5), f"rank {rank} {name}"


def refusals(prefix: str) -> list[str]:
    """The messages of zb-h1 with virtual stages, of zbv with fewer than 2p micro-batches, of
    interleaved without its chunks ("accepted" with them), and of a zbv config given a model built
    for 1F1B (the recipes print them)."""
    from megazero import initialize
    from megazero.config import ConfigError
    from tests.training_helpers import LAYERS_PER_VIRTUAL_STAGE

    messages = []
    virtual = {**MODEL, LAYERS_PER_VIRTUAL_STAGE: 1}
    attempts = [({**_config("zb-h1"), "pipeline": {"schedule": "zb-h1", "num_layers_per_virtual_stage": 1}}, virtual),
                ({**_config("zbv"), "train_batch_size": 4}, MODEL), (_config("interleaved"), MODEL),
                ({**_config("interleaved"), "pipeline": {"schedule": "interleaved", "num_layers_per_virtual_stage": 1}},
                 virtual)]
    for config, model in attempts:
        try:
            build_engine(config, prefix, 0, model, (1, 2))
            messages.append("accepted")
        except ConfigError as e:
            messages.append(str(e))
    engine, _ = build_engine(_config("1f1b"), prefix, 0, MODEL, (1, 2))  # a 1F1B stage, given to zbv
    try:
        initialize(model=engine.module, config=_config("zbv"), mpu=parallel_state)
        messages.append("accepted")
    except ConfigError as e:
        messages.append(str(e))
    return messages


def test_zero_bubble_refusals_name_the_setting(pools, token_dataset_prefix_module):
    virtual, few, interleaved, named, layout = pools(2).run(refusals, token_dataset_prefix_module)[0]
    assert "'pipeline.schedule'='zb-h1' runs one model chunk per stage" in virtual
    assert "pipeline.schedule zbv needs at least 2 x 2 stages = 4 micro-batches per step, got " \
           "gradient_accumulation_steps 2" in few and "lower the micro-batch size (--micro-batch-size)" in few
    assert "'pipeline.schedule'='interleaved' needs 'pipeline.num_layers_per_virtual_stage'" in interleaved
    assert named == "accepted"  # interleaved by name, with its chunks
    assert "zbv runs (and only zbv runs) two chunks per stage in the v layout" in layout
    assert "pipeline_schedule='zbv'" in layout
