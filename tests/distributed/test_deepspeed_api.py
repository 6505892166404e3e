"""The DeepSpeed engine methods users' loops and libraries call, on real gloo ranks, each against
an independent measurement: no_sync, set_gradient_accumulation_boundary, zero_grad,
get_global_grad_norm, was_step_applied, get_mom, module_state_dict, save_16bit_model, the
config/topology getters, and load_checkpoint's load_module_only / load_module_strict."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from megazero.checkpoint import CheckpointError
from megazero.zero import GatheredParameters
from megazero.zero.collectives import traffic
from tests.deepspeed_helpers import TinyNet, TinyNetWithExtra, build_tiny, sgd_config, tiny_config


def _weights(engine) -> dict[str, torch.Tensor]:
    with GatheredParameters(list(engine.module.parameters())):
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def _micro_batches(loader, n: int) -> list:
    data = iter(loader)
    return [next(data) for _ in range(n)]


# ---- no_sync ------------------------------------------------------------------------------------
def _no_sync_against_accumulation(stage: int) -> dict:
    reference, loader = build_tiny(sgd_config(stage, accumulation=3))
    for batch in _micro_batches(loader, 3):  # DeepSpeed's own accumulation: 3 micro-steps, 1 update
        reference.backward(reference(batch))
        reference.step()
    engine, loader = build_tiny(sgd_config(stage, accumulation=1))
    batches = _micro_batches(loader, 3)
    traffic.reset()
    with engine.no_sync():  # DDP style: the user scales the loss and steps once
        for batch in batches[:2]:
            engine.backward(engine(batch) * (1 / 3))
    inside = traffic.sent + traffic.received
    engine.backward(engine(batches[2]) * (1 / 3))
    engine.step()
    return {"inside": inside, "after": traffic.sent, "same_weights": _same(_weights(reference), _weights(engine)),
            "norms": (reference.get_global_grad_norm(), engine.get_global_grad_norm())}


def _same(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ."""
    return [name for name in a if not torch.equal(a[name], b[name])]


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_accumulates_locally_then_reduces_everything(pools, stage):
    for result in pools(2).run(_no_sync_against_accumulation, stage):
        assert result["inside"] == 0, "gradients were communicated inside no_sync"
        assert result["after"] > 0
        assert result["same_weights"] == [], result["same_weights"]
        assert result["norms"][0] == result["norms"][1]


def _no_sync_refusals(stage: int) -> dict:
    engine, loader = build_tiny(sgd_config(stage))
    out = {}
    try:
        with engine.no_sync():
            out["enter"] = "ok"
            with engine.no_sync():
                pass
    except RuntimeError as e:
        out["error"] = str(e)
    if stage < 2:
        with engine.no_sync():
            engine.backward(engine(next(iter(loader))))
            try:
                engine.step()
            except RuntimeError as e:
                out["step"] = str(e)
        out["steps"] = engine.global_steps
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_sync_refusals_as_deepspeed(pools, stage):
    for out in pools(2).run(_no_sync_refusals, stage):
        if stage >= 2:
            assert "enter" not in out
            assert out["error"].startswith(f"no_sync context manager is incompatible with gradient partitioning "
                                           f"logic of ZeRO stage {stage}")
        else:
            assert out["error"] == "no_sync context manager reentry is unsupported"
            assert out["step"] == "It is illegal to call Engine.step() inside no_sync context manager"
            assert out["steps"] == 0


# ---- set_gradient_accumulation_boundary --------------------------------------------------------
def _manual_boundary(stage: int) -> dict:
    reference, loader = build_tiny(sgd_config(stage, accumulation=3))
    for batch in _micro_batches(loader, 3):
        reference.backward(reference(batch))
        reference.step()
    engine, loader = build_tiny(sgd_config(stage, accumulation=3))
    batches = _micro_batches(loader, 3)
    traffic.reset()
    engine.set_gradient_accumulation_boundary(False)  # DeepSpeed's documented pattern: one step() at the end
    for batch in batches[:2]:
        engine.backward(engine(batch))
    inside = traffic.sent
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(batches[2]))
    engine.step()
    try:
        engine.set_gradient_accumulation_boundary(1)
        bad = "accepted"
    except TypeError as e:
        bad = str(e)
    return {"inside": inside, "differ": _same(_weights(reference), _weights(engine)), "steps": engine.global_steps,
            "applied": engine.was_step_applied(), "bad": bad}


@pytest.mark.parametrize("stage", [0, 2])
def test_set_gradient_accumulation_boundary(pools, stage):
    for out in pools(2).run(_manual_boundary, stage):
        assert out["differ"] == [], out["differ"]
        assert out["steps"] == 1 and out["applied"]
        # stage 0 keeps the gradients local until the boundary; stage 2 reduce-scatters every micro-step
        assert (out["inside"] == 0) if stage == 0 else (out["inside"] > 0)
        assert "expects a bool" in out["bad"]


# ---- zero_grad ------------------------------------------------------------------------------------
def _zero_grad_discards(stage: int) -> list[str]:
    reference, loader = build_tiny(sgd_config(stage))
    first, second = _micro_batches(loader, 2)
    reference(first)  # same dropout draws as below, no gradient from `first`
    reference.backward(reference(second))
    reference.step()
    engine, loader = build_tiny(sgd_config(stage))
    first, second = _micro_batches(loader, 2)
    engine.backward(engine(first))  # a boundary: its reduction is in flight when zero_grad() comes
    engine.zero_grad()
    engine.backward(engine(second))
    engine.step()
    return _same(_weights(reference), _weights(engine))


@pytest.mark.parametrize("stage", [0, 2])
def test_zero_grad_discards_accumulated_gradients(pools, stage):
    assert pools(2).run(_zero_grad_discards, stage) == [[], []]


# ---- get_global_grad_norm, was_step_applied ----------------------------------------------------
def _norm_and_applied(clip: float) -> dict:
    lr = 1.0
    engine, loader = build_tiny(sgd_config(0, accumulation=2, lr=lr, gradient_clipping=clip))
    out = {"before": (engine.get_global_grad_norm(), engine.was_step_applied())}
    start = _weights(engine)
    applied = []
    for batch in _micro_batches(loader, 2):
        engine.backward(engine(batch))
        engine.step()
        applied.append(engine.was_step_applied())
    update = torch.cat([(start[n] - p).reshape(-1) for n, p in _weights(engine).items()])
    out.update(applied=applied, norm=engine.get_global_grad_norm(), update_norm=float(update.norm()) / lr)
    return out


def test_global_grad_norm_is_the_unclipped_norm_of_the_applied_gradient(pools):
    for out in pools(2).run(_norm_and_applied, 0.0):
        assert out["before"] == (None, False)
        assert out["applied"] == [False, True]
        assert out["norm"] == pytest.approx(out["update_norm"], rel=1e-5)
    clip = 0.05
    for out in pools(2).run(_norm_and_applied, clip):
        assert out["norm"] > 2 * clip  # reported before clipping ...
        assert out["update_norm"] == pytest.approx(clip, rel=1e-4)  # ... while the step applied the clipped one


def _overflow_step() -> dict:
    engine, loader = build_tiny(sgd_config(0, fp16={"enabled": True, "initial_scale_power": 40}))
    engine.backward(engine(next(iter(loader))))
    engine.step()
    return {"applied": engine.was_step_applied(), "norm": engine.get_global_grad_norm(),
            "skipped": engine.skipped_steps}


def test_overflow_step_is_not_applied(pools):
    for out in pools(2).run(_overflow_step):
        assert out["applied"] is False and out["skipped"] == 1
        assert not torch.isfinite(torch.tensor(out["norm"]))


# ---- getters ---------------------------------------------------------------------------------------
def _getters() -> dict:
    bf16, _ = build_tiny(tiny_config(2, bf16={"enabled": True}))
    momentum = tiny_config(1, fp16={"enabled": True}, optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}})
    adagrad = tiny_config(0, optimizer={"type": "Adagrad", "params": {"lr": 0.1}})
    for config in (momentum, adagrad):
        config.pop("scheduler")
    fp16, _ = build_tiny(momentum)
    adagrad, _ = build_tiny(adagrad)
    return {"stage": (bf16.zero_optimization_stage(), fp16.zero_optimization_stage()),
            "bf16": (bf16.bfloat16_enabled(), bf16.fp16_enabled()), "fp16": (fp16.bfloat16_enabled(),
                                                                              fp16.fp16_enabled()),
            "mom": ([tuple(m) for m in bf16.get_mom()], fp16.get_mom(), adagrad.get_mom()),
            "local_rank": bf16.local_rank, "env_local_rank": int(os.environ["LOCAL_RANK"]),
            "world_size": bf16.world_size}


def test_config_and_topology_getters(pools):
    for rank, out in enumerate(pools(2).run(_getters)):
        assert out["stage"] == (2, 1)
        assert out["bf16"] == (True, False) and out["fp16"] == (False, True)
        assert out["mom"] == ([(0.9, 0.999)], [0.9], [0.0])
        assert out["local_rank"] == out["env_local_rank"] == rank
        assert out["world_size"] == 2


def _module_state_dict() -> dict:
    torch.manual_seed(0)
    net = TinyNet()
    net.norm.weight.requires_grad_(False)
    import megazero
    from tests.deepspeed_helpers import RegressionData

    engine, *_ = megazero.initialize(model=net, training_data=RegressionData(), config=sgd_config(1))
    full = engine.module_state_dict()
    expected = net.state_dict()
    return {"keys": list(full) == list(expected), "equal": all(torch.equal(full[k], expected[k]) for k in expected),
            "prefixed": sorted(engine.module_state_dict(prefix="model."))[:1],
            "without_frozen": sorted(set(full) - set(engine.module_state_dict(exclude_frozen_parameters=True)))}


def test_module_state_dict(pools):
    for out in pools(2).run(_module_state_dict):
        assert out["keys"] and out["equal"]
        assert out["prefixed"] == ["model.embed.weight"]
        assert out["without_frozen"] == ["norm.weight"]


# ---- save_16bit_model ------------------------------------------------------------------------------
def _save_16bit(stage: int, gather: bool, save_dir: str, trained: bool) -> dict:
    config = sgd_config(stage, bf16={"enabled": True},
                        zero_optimization={"stage3_gather_16bit_weights_on_model_save": gather})
    torch.manual_seed(0)
    initial = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in TinyNet().state_dict().items()}
    engine, loader = build_tiny(config)
    if trained:
        for batch in _micro_batches(loader, 2):
            engine.backward(engine(batch))
            engine.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = [engine.save_16bit_model(save_dir), engine.save_16bit_model(save_dir, "model.safetensors")]
    expected = {k: v.clone() for k, v in _weights(engine).items()} if stage != 3 else None
    if stage != 3:
        expected.update({k: v for k, v in engine.module.state_dict().items() if k not in expected})
    return {"saved": saved, "initial": initial, "expected": expected,
            "warnings": [str(w.message) for w in caught if "did not save" in str(w.message)]}


def _read_16bit(save_dir: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return (torch.load(os.path.join(save_dir, "pytorch_model.bin"), weights_only=True),
            load_file(os.path.join(save_dir, "model.safetensors")))


@pytest.mark.parametrize("stage", [0, 1])
def test_save_16bit_model(pools, tmp_path, stage):
    results = pools(2).run(_save_16bit, stage, False, str(tmp_path), True)
    assert [r["saved"] for r in results] == [[True, True], [True, True]]
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "pytorch_model.bin"]  # nothing temporary left
    expected = results[0]["expected"]
    for weights in _read_16bit(str(tmp_path)):
        assert sorted(weights) == sorted(results[0]["initial"])  # every key, tied ones and buffers included
        for name, tensor in weights.items():
            assert tensor.dtype == results[0]["initial"][name].dtype, name
            assert torch.equal(tensor, expected[name]), name
        assert not torch.equal(weights["layers.0.weight"], results[0]["initial"]["layers.0.weight"])  # trained
        assert torch.equal(weights["unembed.weight"], weights["embed.weight"])


def test_save_16bit_model_zero3_gathers_only_when_configured(pools, tmp_path):
    results = pools(2).run(_save_16bit, 3, False, str(tmp_path / "no"), False)
    assert [r["saved"] for r in results] == [[False, False], [False, False]]
    assert len(results[0]["warnings"]) == 2 and "stage3_gather_16bit_weights_on_model_save" in results[0]["warnings"][0]
    assert not (tmp_path / "no").exists()
    results = pools(2).run(_save_16bit, 3, True, str(tmp_path / "yes"), False)
    assert [r["saved"] for r in results] == [[True, True], [True, True]]
    initial = results[0]["initial"]
    for weights in _read_16bit(str(tmp_path / "yes")):
        assert sorted(weights) == sorted(initial)
        for name, tensor in initial.items():  # whole, gathered from both ranks' partitions
            assert torch.equal(weights[name], tensor), name


def _save_16bit_model_parallel(prefix: str, save_dir: str) -> str:
    from tests.training_helpers import base_config, build_engine

    engine, _ = build_engine(base_config(), prefix, layout=(2, 1))
    try:
        engine.save_16bit_model(save_dir)
    except ValueError as e:
        return str(e)
    return "saved"


def test_save_16bit_model_refuses_a_split_model(pools, token_dataset_prefix_module, tmp_path):
    for message in pools(2).run(_save_16bit_model_parallel, token_dataset_prefix_module, str(tmp_path)):
        assert "tensor parallel 2, pipeline 1" in message and "scripts/export_hf.py" in message
    assert not any(tmp_path.iterdir())


# ---- load_checkpoint(load_module_only, load_module_strict) -------------------------------------
def _module_only(stage: int, save_dir: str) -> dict:
    source, loader = build_tiny(tiny_config(stage, bf16={"enabled": True}))
    for batch in _micro_batches(loader, 2):
        source.backward(source(batch))
        source.step()
    source.save_checkpoint(save_dir, client_state={"note": "warm start"})
    trained = _weights(source)
    # another seed, and an optimizer that leaves the weights as they are: a step re-writes the model
    # from the fp32 masters, so it shows whether they were refreshed too
    fresh, loader = build_tiny(sgd_config(stage, lr=0.0, bf16={"enabled": True}), seed=1)
    path, client = fresh.load_checkpoint(save_dir, load_module_only=True)
    loaded = _same(trained, _weights(fresh))
    state = (fresh.global_steps, fresh.micro_steps, len(fresh.optimizer.state))
    fresh.backward(fresh(next(iter(loader))))
    fresh.step()
    return {"path": path, "client": client, "loaded": loaded, "state": state,
            "after_step": _same(trained, _weights(fresh))}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_load_module_only(pools, tmp_path, stage):
    for out in pools(2).run(_module_only, stage, str(tmp_path)):
        assert out["path"] == str(tmp_path / "global_step2") and out["client"] == {"note": "warm start"}
        assert out["loaded"] == [], out["loaded"]
        assert out["state"] == (0, 0, 0)  # counters and optimizer state untouched
        assert out["after_step"] == [], "the fp32 master weights were not refreshed from the loaded weights"


def _strictness(stage: int, save_dir: str) -> dict:
    source, _ = build_tiny(sgd_config(stage))
    source.save_checkpoint(save_dir)
    trained = _weights(source)
    target, _ = build_tiny(sgd_config(stage), seed=1, model_class=TinyNetWithExtra)
    extra_before = _weights(target)["extra.weight"]
    out = {}
    try:
        target.load_checkpoint(save_dir, load_module_only=True)
    except CheckpointError as e:
        out["strict"] = str(e)
    try:
        target.load_checkpoint(save_dir, load_module_only=True, load_module_strict=False)
        after = _weights(target)
        out["loose"] = (_same(trained, after), torch.equal(after["extra.weight"], extra_before))
    except CheckpointError as e:
        out["loose"] = str(e)
    return out


def test_load_module_strict(pools, tmp_path):
    for out in pools(2).run(_strictness, 0, str(tmp_path / "z0")):
        assert "Missing key(s)" in out["strict"] and '"extra.weight"' in out["strict"]
        assert out["loose"] == ([], True)
    for out in pools(2).run(_strictness, 3, str(tmp_path / "z3")):  # per-parameter matching: strict only
        assert "parameter extra.weight is not in the checkpoint" in out["strict"]
        assert "load_module_strict=False needs the saved tensor/pipeline layout and no ZeRO-3" in out["loose"]


# ---- load_checkpoint(load_optimizer_states=False) at the same layout ---------------------------
def _load_without_optimizer_states(save_dir: str) -> dict:
    engine, loader = build_tiny(tiny_config(2))
    engine.backward(engine(next(iter(loader))))
    engine.step()
    engine.save_checkpoint(save_dir)
    after_save = torch.rand(3)  # the user's own random numbers, right after the save
    fresh, _ = build_tiny(tiny_config(2), seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.load_checkpoint(save_dir, load_optimizer_states=False)
    return {"same_draw": torch.equal(torch.rand(3), after_save), "warnings": [str(w.message) for w in caught],
            "steps": fresh.global_steps}


def test_load_without_optimizer_states_still_restores_this_ranks_rng(pools, tmp_path):
    """Skipping the optimizer states reads the weights per parameter, but the ranks are the same
    ones in the same places: each still gets its own generator states back, with no warning."""
    for result in pools(2).run(_load_without_optimizer_states, str(tmp_path)):
        assert result["same_draw"] and result["steps"] == 1
        assert not [w for w in result["warnings"] if "not restored" in w], result["warnings"]
