"""Which optimizer `build_optimizer` picks for each config and parameter set, with which settings:
the fused CPU op for fp32 CPU params, torch's fused Adam with `torch_adam: true` or `amsgrad`,
torch's optimizers otherwise, DeepSpeed's weight_decay default 0; and what the engine may ask
of each (the capability protocol in megazero.optim.protocol)."""

from __future__ import annotations

import pytest
import torch

from megazero.config import parse_config
from megazero.ops.cpu_optimizers import FusedCPUAdagrad, FusedCPUAdam, FusedCPULamb, cpu_optimizers_op
from megazero.optim import build_optimizer
from megazero.optim.lion import Lion
from megazero.optim.protocol import takes_grad_scale, writes_copies


@pytest.fixture(scope="module", autouse=True)
def op():
    if cpu_optimizers_op() is None:
        pytest.fail("the cpu_optimizers op did not build (see the warning); it must build on this machine")


def _build(kind: str, params: dict | None = None, tensors=None):
    config = parse_config({"train_batch_size": 1, "optimizer": {"type": kind, "params": params or {}}}, 1)
    if tensors is None:
        tensors = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    return build_optimizer(config.optimizer, tensors)


def _settings(optimizer) -> dict:
    group = optimizer.param_groups[0]
    return {k: v for k, v in group.items() if k != "params"}


def test_adam_defaults_to_the_fused_cpu_op_in_adamw_mode():
    opt = _build("Adam", {"lr": 0.1})
    assert type(opt) is FusedCPUAdam
    assert _settings(opt) == {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                              "adamw_mode": True, "bias_correction": True}
    assert opt._use_op is None  # the op where it builds, the reference where it does not


def test_adam_w_mode_false_is_l2_adam():
    assert _settings(_build("Adam", {"adam_w_mode": False}))["adamw_mode"] is False
    opt = _build("Adam", {"adam_w_mode": False, "torch_adam": True})
    assert type(opt) is torch.optim.Adam and opt.defaults["fused"] is True


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "adamw"])
def test_torch_adam_takes_torchs_fused_adamw_with_deepspeeds_weight_decay(kind):
    opt = _build(kind, {"torch_adam": True, "betas": [0.8, 0.9]})
    assert type(opt) is torch.optim.AdamW
    assert opt.defaults["fused"] is True and opt.defaults["betas"] == (0.8, 0.9)
    assert opt.defaults["weight_decay"] == 0.0  # DeepSpeed's default, not torch's AdamW 0.01


def test_amsgrad_takes_torchs_optimizer():
    opt = _build("AdamW", {"amsgrad": True, "weight_decay": 0.1})
    assert type(opt) is torch.optim.AdamW and opt.defaults["amsgrad"] is True
    assert opt.defaults["weight_decay"] == 0.1
    assert type(_build("AdamW", {"amsgrad": False})) is FusedCPUAdam


def test_adam_without_bias_correction_runs_megazeros_adam():
    opt = _build("Adam", {"bias_correction": False})
    assert type(opt) is FusedCPUAdam and opt.defaults["bias_correction"] is False
    with pytest.raises(ValueError, match="bias_correction' false with 'optimizer.params.amsgrad' true"):
        _build("Adam", {"bias_correction": False, "amsgrad": True})


def test_16_bit_or_mixed_params_take_torchs_adam():
    bf16 = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    opt = _build("AdamW", {}, bf16)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    mixed = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    assert type(_build("Adagrad", {}, mixed)) is torch.optim.Adagrad


def test_param_groups_keep_their_own_settings():
    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))], "weight_decay": 0.5},
              {"params": [torch.nn.Parameter(torch.zeros(3))]}]
    opt = _build("AdamW", {"weight_decay": 0.1}, groups)
    assert type(opt) is FusedCPUAdam
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.1]


def test_sgd_is_torchs():
    opt = _build("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True})
    assert type(opt) is torch.optim.SGD
    assert opt.defaults["momentum"] == 0.9 and opt.defaults["nesterov"] is True


def test_adagrad_takes_the_op_unless_torch_adam():
    opt = _build("Adagrad", {"lr": 0.2, "lr_decay": 0.01})
    assert type(opt) is FusedCPUAdagrad and _settings(opt)["lr_decay"] == 0.01
    assert type(_build("Adagrad", {"torch_adam": True})) is torch.optim.Adagrad


def test_lamb_takes_the_op_or_its_reference():
    opt = _build("Lamb", {"max_coeff": 5.0, "bias_correction": False})
    assert type(opt) is FusedCPULamb and opt._use_op is None
    assert _settings(opt)["max_coeff"] == 5.0 and _settings(opt)["bias_correction"] is False
    reference = _build("Lamb", {"torch_adam": True})
    assert type(reference) is FusedCPULamb and reference._use_op is False and reference.op is None


def test_lion_is_its_torch_implementation():
    opt = _build("Lion", {"lr": 3e-4, "betas": [0.95, 0.98], "weight_decay": 0.1})
    assert type(opt) is Lion
    assert _settings(opt) == {"lr": 3e-4, "betas": (0.95, 0.98), "weight_decay": 0.1}
    assert _settings(_build("Lion")) == {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0}


@pytest.mark.parametrize("kind,params,scale,copies", [
    ("AdamW", {}, True, True),                      # megazero's op: both
    ("AdamW", {"torch_adam": True}, True, False),   # torch's fused Adam reads grad_scale
    ("AdamW", {"amsgrad": True}, True, False),
    ("Adam", {"adam_w_mode": False, "torch_adam": True}, True, False),
    ("Lamb", {"torch_adam": True}, True, True),     # the reference honours the same protocol
    ("Adagrad", {"torch_adam": True}, False, False),
    ("SGD", {}, False, False),
    ("Lion", {}, False, False),                     # the engine unscales its gradients first
])
def test_what_the_engine_may_ask(kind, params, scale, copies):
    opt = _build(kind, params)
    assert (takes_grad_scale(opt), writes_copies(opt)) == (scale, copies)


def test_torchs_unfused_adam_does_not_take_a_grad_scale():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], fused=False)
    assert not takes_grad_scale(opt) and not writes_copies(opt)
