"""DeepSpeed's config keys megazero implements, on real gloo ranks, each against a measurement that
fails without it: prescale_gradients / gradient_predivide_factor (what the reduction carries),
allgather_partitions / allgather_bucket_size (the collectives of stages 1-2's parameter gather),
fp16.auto_cast (the dtype the model's forward receives)."""

from __future__ import annotations

import pytest
import torch

import megazero.zero.partitioned as partitioned
import megazero.zero.replicated as replicated
import megazero.zero.shard_buckets as shard_buckets
from megazero.zero import GatheredParameters
from megazero.zero.collectives import traffic
from tests.deepspeed_helpers import build_tiny, sgd_config, tiny_config


def _one_step(config: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """(largest |value| handed to a gradient reduction, the weights after one step)."""
    largest = [0.0]
    patched = [(replicated, "all_reduce"), (partitioned, "reduce_scatter_chunks"),
                (shard_buckets, "reduce_scatter_chunks")]
    originals = [getattr(module, name) for module, name in patched]

    def recording(original):
        def reduce(tensor, *args, **kwargs):
            largest[0] = max(largest[0], tensor.abs().max().item())
            return original(tensor, *args, **kwargs)
        return reduce

    for (module, name), original in zip(patched, originals):
        setattr(module, name, recording(original))
    try:
        engine, loader = build_tiny(config)
        engine.backward(engine(next(iter(loader))))
        engine.step()
    finally:
        for (module, name), original in zip(patched, originals):
            setattr(module, name, original)
    with GatheredParameters(list(engine.module.parameters())):
        return largest[0], {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _averaging(stage: int) -> dict:
    post, post_weights = _one_step(sgd_config(stage))  # DeepSpeed's default: raw gradients summed, the sum divided
    pre, weights = _one_step(sgd_config(stage, prescale_gradients=True))
    factor, weights_factor = _one_step(sgd_config(stage, gradient_predivide_factor=4.0))
    same = all(torch.equal(weights[n], w[n]) for w in (weights_factor, post_weights) for n in weights)
    return {"post_over_pre": post / pre, "factor_over_pre": factor / pre, "same_weights": same}


def test_prescale_and_predivide_set_what_the_reduction_carries(pools):
    for out in pools(2).run(_averaging, 0):
        # DP 2: dividing by 1, 2 or 4 before and the rest after is exact, so the weights agree bit for bit
        assert out == {"post_over_pre": 2.0, "factor_over_pre": 0.5, "same_weights": True}


def _stage_averaging(stage: int) -> dict:
    divided, _ = _one_step(sgd_config(stage))
    raw, _ = _one_step(sgd_config(0))
    refused = []
    for keys in ({"prescale_gradients": True}, {"gradient_predivide_factor": 4.0}):
        try:
            _one_step(sgd_config(stage, **keys))
        except ValueError as e:
            refused.append("divide the gradients by the data-parallel size before their reduce-scatter" in str(e))
    return {"raw_over_divided": raw / divided, "refused": refused}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stages_1_to_3_divide_before_their_reduce_scatter_and_refuse_the_keys(pools, stage):
    for out in pools(2).run(_stage_averaging, stage):
        assert out == {"raw_over_divided": 2.0, "refused": [True, True]}


def _gathers(stage: int) -> dict:
    results = {}
    for name, zero in (("default", {}), ("broadcast", {"allgather_partitions": False}),
                       ("small", {"allgather_bucket_size": 64})):
        config = tiny_config(stage, zero_optimization={"reduce_bucket_size": 100_000, **zero})
        engine, loader = build_tiny(config)
        engine.backward(engine(next(iter(loader))))
        traffic.reset()
        engine.step()
        calls, largest = dict(traffic.calls), dict(traffic.largest)
        with GatheredParameters(list(engine.module.parameters())):
            weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        results[name] = (calls.get("all_gather", 0), calls.get("broadcast", 0), largest.get("all_gather", 0), weights)
    default = results["default"][3]
    same = all(torch.equal(default[n], results[k][3][n]) for k in ("broadcast", "small") for n in default)
    return {k: v[:3] for k, v in results.items()} | {"same": same}


@pytest.mark.parametrize("stage", [1, 2])
def test_allgather_partitions_and_bucket_size(pools, stage):
    for out in pools(2).run(_gathers, stage):
        gathers, broadcasts, largest = out["default"]
        assert gathers >= 1 and broadcasts == 0 and largest > 64  # one bucket, one all-gather
        assert out["broadcast"][:2] == (0, 2 * gathers)  # each rank broadcasts its chunk of each bucket
        assert out["small"][0] > gathers and 0 < out["small"][2] <= 64
        assert out["same"]


def _input_dtypes(auto_cast: bool) -> list[str]:
    seen = []
    engine, loader = build_tiny(tiny_config(0, fp16={"enabled": True, "auto_cast": auto_cast}))
    engine.module.register_forward_pre_hook(lambda module, args: seen.append(str(args[0]["x"].dtype)))
    engine(next(iter(loader)))
    return seen


def test_fp16_auto_cast_casts_the_forwards_floating_inputs(pools):
    assert pools(1).run(_input_dtypes, True) == [["torch.float16"]]
    assert pools(1).run(_input_dtypes, False) == [["torch.float32"]]


def _client_optimizer(stage: int, allow: bool) -> dict:
    import warnings

    import megazero
    from tests.deepspeed_helpers import RegressionData, TinyNet

    config = tiny_config(stage, zero_allow_untested_optimizer=allow)
    config.pop("optimizer")
    config.pop("scheduler")
    torch.manual_seed(0)
    net = TinyNet(0.0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine, _, loader, _ = megazero.initialize(model=net, optimizer=torch.optim.RMSprop(net.parameters()),
                                                       training_data=RegressionData(), config=config)
            engine.backward(engine(next(iter(loader))))
            engine.step()
    except ValueError as e:
        return {"refused": "zero_allow_untested_optimizer" in str(e)}
    return {"warned": any("untested optimizer RMSprop" in str(w.message) for w in caught),
            "stepped": engine.global_steps == 1}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_client_optimizer_under_zero_needs_zero_allow_untested_optimizer(pools, stage):
    for out in pools(2).run(_client_optimizer, stage, False):
        assert out == {"refused": True}
    for out in pools(2).run(_client_optimizer, stage, True):
        assert out == {"warned": True, "stepped": True}
