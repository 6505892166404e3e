"""ZeRO-3 units for any nn.Module: every module owning parameters is fetched just before its forward
and released after (and again for its backward), whether the layers are in an nn.Sequential, an
nn.ModuleList or named attributes. So the parameter bytes gathered at once during a training step
stay under two units (the one computing and the next, prefetched) plus the persistent ones, and the
training equals the stage-0 run at the same DP=2 (dropout on). A fourth model covers what stays
gathered on purpose: a weight tied between an embedding and a functional output layer, a parameter
a parent reads, and a layer called twice per forward."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import megazero
from tests.training_helpers import base_config, full_parameters, global_mean

WIDTH = 64
STEPS = 4
# biases (64 elements) stay whole on every rank; every 64 x 64 weight is partitioned
PERSISTENCE = 1000
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": PERSISTENCE, "reduce_bucket_size": 2000}
# the same DP=2 batches and dropout masks at both stages: only the order of the gradient norm's
# summation differs (flat buffers vs partitions)
LOSS_RTOL = 1e-6
PARAM_ATOL = 1e-6


class Regression(nn.Module):
    """Mean squared error of `body` (what the three layouts differ in) on (x, y)."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.body(x), y)


class Residual(nn.Module):
    """x + fc2(gelu(fc1(x)))."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class ListBody(nn.Module):
    """Input and output layers as attributes around an nn.ModuleList of residual blocks."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList([Residual(), Residual()])
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class NamedBody(nn.Module):
    """Four layers as named attributes, with dropout."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.third, self.last = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(torch.tanh(self.first(x)), 0.1, self.training)
        x = F.dropout(torch.tanh(self.second(x)), 0.1, self.training)
        return self.last(torch.tanh(self.third(x)))


class Shared(nn.Module):
    """Parameters used outside their module's forward: the output layer is the embedding's weight,
    the gate's weight is read by this module, and `mid` runs twice."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(WIDTH, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.gate = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.embed(x))
        h = torch.tanh(self.mid(h))
        h = h * torch.sigmoid(F.linear(h, self.gate.weight, self.gate.bias))
        h = torch.tanh(self.mid(h))
        logits = F.linear(h, self.embed.weight)
        return F.cross_entropy(logits.reshape(-1, WIDTH), y.reshape(-1))


def _sequential() -> nn.Module:
    return Regression(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Dropout(0.1), nn.Linear(WIDTH, WIDTH),
                                    nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH)))


MODELS = {"sequential": _sequential, "module_list": lambda: Regression(ListBody()),
          "named_attributes": lambda: Regression(NamedBody()), "shared": Shared}


def _batches(name: str, rank: int):
    """This rank's two micro-batches of 2 samples (x, y), repeated every step (so the loss falls)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    if name == "shared":
        def draw() -> torch.Tensor:
            return torch.randint(0, WIDTH, (2, 8), generator=gen)
    else:
        def draw() -> torch.Tensor:
            return torch.randn(2, WIDTH, generator=gen)
    fixed = [{"x": draw(), "y": draw()} for _ in range(2)]
    while True:
        yield from fixed


def _unit_bound(model: nn.Module) -> tuple[int, int]:
    """(bytes of the two largest modules' partitioned parameters, bytes of all persistent ones), from
    the model alone: what the old whole-model or whole-layer units would exceed."""
    units = sorted((sum(p.numel() * p.element_size() for p in m.parameters(recurse=False) if p.numel() >= PERSISTENCE)
                    for m in model.modules()), reverse=True)
    persistent = sum(p.numel() * p.element_size() for p in model.parameters() if p.numel() < PERSISTENCE)
    return units[0] + units[1], persistent


def _watch_whole_bytes(model: nn.Module, seen: list[int]) -> None:
    """Record the bytes of parameters whole right now at every module's forward entry and exit and at
    every gradient's arrival (partitioned parameters are empty tensors while released)."""
    def sample(*_):
        seen.append(sum(p.numel() * p.element_size() for p in model.parameters()))

    def on_output(module, args, output):
        sample()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: sample())

    for module in model.modules():
        module.register_forward_pre_hook(sample)
        module.register_forward_hook(on_output)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(sample)


def _train_models(stage: int) -> dict:
    """Each model: STEPS optimizer steps of 2 accumulated micro-batches of 2 per rank at `stage`;
    the losses, the final weights and (stage 3) the peak bytes whole at once."""
    out = {}
    for name, build in MODELS.items():
        megazero.set_seed(0)
        model = build()
        bound = _unit_bound(model)
        zero = ZERO3 if stage == 3 else {"stage": 0, "reduce_bucket_size": 2000}
        engine, _, _, _ = megazero.initialize(model=model, config=base_config(zero_optimization=zero))
        seen: list[int] = []
        _watch_whole_bytes(engine.module, seen)
        data = _batches(name, engine.dp_rank)
        losses, fetched = [], []
        for _ in range(STEPS):
            if stage == 3:
                engine.dp.fetcher.reset_peak()
            losses.append(global_mean(engine.train_batch(data).item(), engine))
            if stage == 3:
                fetched.append(engine.dp.fetcher.peak_bytes)
        out[name] = {"losses": losses, "params": full_parameters(engine), "bound": bound,
                     "whole_peak": max(seen), "fetched_peak": max(fetched, default=0),
                     "prefetches": engine.dp.prefetches if stage == 3 else 0}
    return out


def test_units_for_any_module_bound_the_gathered_bytes_and_train_exactly(pools):
    reference = pools(2).run(_train_models, 0)
    for rank, result in enumerate(pools(2).run(_train_models, 3)):
        for name, run in result.items():
            ref = reference[rank][name]
            for step, (a, b) in enumerate(zip(ref["losses"], run["losses"], strict=True)):
                assert abs(a - b) <= LOSS_RTOL * abs(a), f"{name} step {step}: loss {a} vs {b}"
            for param, value in ref["params"].items():
                torch.testing.assert_close(run["params"][param], value, rtol=0, atol=PARAM_ATOL, msg=f"{name} {param}")
            assert ref["losses"][-1] < ref["losses"][0], (name, ref["losses"])
            if name == "shared":
                continue  # the tied embedding stays whole from the output layer's read to its gradient
            two_units, persistent = run["bound"]
            # measured whole on a rank: at most the unit computing and the next one (prefetched)
            assert run["whole_peak"] <= two_units + persistent, (name, run["whole_peak"], run["bound"])
            # counted by the fetcher: gathers in flight (the prefetched unit's buffer) included
            assert run["fetched_peak"] <= two_units, (name, run["fetched_peak"], run["bound"])
            assert run["prefetches"] > 0, name  # the bound holds with prefetching on
