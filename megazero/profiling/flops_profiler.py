"""FLOPs profiler: parameters, MACs, FLOPs, latency and FLOP/s per module, from one forward pass.

While profiling, the torch functions that do the arithmetic are wrapped to count their work, and
module hooks attribute it to the module that is running (a module's counts include its children).
Counting rules (one multiply-add = one MAC = two FLOPs):
- linear: (input elements / in_features) x in x out MACs, plus one FLOP per output for the bias;
- conv1d/2d/3d: output elements x (in_channels / groups) x kernel size MACs, plus the bias;
- matmul / bmm / mm / @: output elements x the contracted size MACs;
- scaled_dot_product_attention: B H Lq Lk E (scores) + B H Lq Lk Ev (weighted values) MACs, plus
  one FLOP per score for the softmax (the full matrix also when causal);
- layer_norm: 5 FLOPs per element with affine weights, else 4; softmax, relu, gelu, silu, tanh,
  sigmoid and max/avg pooling: 1 FLOP per input element.
The backward pass is reported as twice the forward (two matmuls per forward matmul).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _numel(t) -> int:
    return t.numel() if isinstance(t, torch.Tensor) else 0


def _linear(args, kwargs, out):
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    macs = x.numel() // w.shape[-1] * w.shape[-1] * w.shape[0]
    return 2 * macs + (_numel(out) if bias is not None else 0), macs


def _conv(args, kwargs, out):
    w = args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    macs = out.numel() * w.shape[1] * math.prod(w.shape[2:])  # w: out, in / groups, *kernel
    return 2 * macs + (out.numel() if bias is not None else 0), macs


def _matmul(args, kwargs, out):
    macs = out.numel() * args[0].shape[-1]
    return 2 * macs, macs


def _sdpa(args, kwargs, out):
    q, k, v = args[:3]
    scores = q.numel() // q.shape[-1] * k.shape[-2]  # B H Lq Lk
    macs = scores * q.shape[-1] + scores * v.shape[-1]
    return 2 * macs + scores, macs


def _layer_norm(args, kwargs, out):
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    return args[0].numel() * (5 if weight is not None else 4), 0


def _elementwise(args, kwargs, out):
    return _numel(args[0]), 0


_COUNTED: dict[tuple[object, str], Callable] = {
    (F, "linear"): _linear, (F, "conv1d"): _conv, (F, "conv2d"): _conv, (F, "conv3d"): _conv,
    (torch, "matmul"): _matmul, (torch, "bmm"): _matmul, (torch, "mm"): _matmul,
    (torch.Tensor, "__matmul__"): _matmul,
    (F, "scaled_dot_product_attention"): _sdpa, (F, "layer_norm"): _layer_norm,
    (F, "softmax"): _elementwise, (F, "relu"): _elementwise, (F, "gelu"): _elementwise,
    (F, "silu"): _elementwise, (torch, "tanh"): _elementwise, (torch, "sigmoid"): _elementwise,
    (F, "max_pool2d"): _elementwise, (F, "avg_pool2d"): _elementwise,
}


class _Stats:
    def __init__(self):
        self.flops = 0
        self.macs = 0
        self.latency = 0.0
        self.calls = 0


class FlopsProfiler:
    """Profile `model`: start_profile(), run a forward, stop_profile(), then read or print the results."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.flops = 0
        self.macs = 0
        self.stats: dict[torch.nn.Module, _Stats] = {}
        self._originals: dict[tuple[object, str], Callable] = {}
        self._hooks: list = []
        self._entry: dict[int, tuple[int, int, float]] = {}
        self.active = False

    # ---- counting -----------------------------------------------------------------------------
    def _wrap(self, fn: Callable, rule: Callable) -> Callable:
        def counted(*args, **kwargs):
            out = fn(*args, **kwargs)
            if self.active:
                flops, macs = rule(args, kwargs, out)
                self.flops += flops
                self.macs += macs
            return out
        return counted

    def _pre(self, module, args) -> None:
        self._entry[id(module)] = (self.flops, self.macs, time.perf_counter())

    def _post(self, module, args, out) -> None:
        flops, macs, start = self._entry.pop(id(module), (self.flops, self.macs, time.perf_counter()))
        stats = self.stats.setdefault(module, _Stats())
        stats.flops += self.flops - flops
        stats.macs += self.macs - macs
        stats.latency += time.perf_counter() - start
        stats.calls += 1

    def start_profile(self) -> None:
        """Start counting (patches the counted torch functions and hooks every module)."""
        self.end_profile()
        for (owner, name), rule in _COUNTED.items():
            self._originals[(owner, name)] = getattr(owner, name)
            setattr(owner, name, self._wrap(getattr(owner, name), rule))
        for module in self.model.modules():
            self._hooks.append(module.register_forward_pre_hook(self._pre))
            self._hooks.append(module.register_forward_hook(self._post))
        self.active = True

    def stop_profile(self) -> None:
        """Stop counting (restores torch); the numbers stay readable."""
        self.active = False
        for (owner, name), original in self._originals.items():
            setattr(owner, name, original)
        self._originals.clear()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def end_profile(self) -> None:
        """Stop and forget the numbers."""
        self.stop_profile()
        self.flops = self.macs = 0
        self.stats.clear()

    # ---- results ------------------------------------------------------------------------------
    def get_total_flops(self) -> int:
        """Forward FLOPs counted."""
        return self.flops

    def get_total_macs(self) -> int:
        """Forward MACs counted."""
        return self.macs

    def get_total_params(self) -> int:
        """Parameters of the model (a tied one counted once)."""
        return sum(p.numel() for p in self.model.parameters())

    def get_total_duration(self) -> float:
        """Seconds of the root module's forward."""
        return self.stats[self.model].latency if self.model in self.stats else 0.0

    def print_model_profile(self, module_depth: int = -1, top_modules: int = 1, detailed: bool = True,
                            output_file: str | None = None) -> str:
        """The profile as text: totals, the top modules at each depth, and (detailed) the module tree."""
        lines = [f"params: {self.get_total_params():,} | forward MACs: {_human(self.macs)} | forward FLOPs: "
                 f"{_human(self.flops)} | backward FLOPs (2x forward): {_human(2 * self.flops)} | "
                 f"forward latency: {1000 * self.get_total_duration():.2f} ms | "
                 f"forward FLOP/s: {_human(self.flops / max(self.get_total_duration(), 1e-12))}"]
        by_depth: dict[int, list] = {}
        for name, module in self.model.named_modules():
            depth = 0 if not name else name.count(".") + 1
            if module in self.stats:
                by_depth.setdefault(depth, []).append((name or "(model)", module))
        for depth in sorted(by_depth):
            if module_depth >= 0 and depth > module_depth:
                break
            top = sorted(by_depth[depth], key=lambda item: -self.stats[item[1]].macs)[:top_modules]
            lines.append(f"depth {depth}: top {len(top)} by MACs: "
                         + ", ".join(f"{name} {_human(self.stats[m].macs)}MACs" for name, m in top))
        if detailed:
            lines.append("module | params | MACs | FLOPs | latency ms | FLOP/s")
            for name, module in self.model.named_modules():
                depth = 0 if not name else name.count(".") + 1
                if module not in self.stats or (module_depth >= 0 and depth > module_depth):
                    continue
                s = self.stats[module]
                params = sum(p.numel() for p in module.parameters())
                lines.append(f"{'  ' * depth}{name or '(model)'} ({type(module).__name__}) | {params:,} | "
                             f"{_human(s.macs)} | {_human(s.flops)} | {1000 * s.latency:.2f} | "
                             f"{_human(s.flops / max(s.latency, 1e-12))}")
        text = "\n".join(lines)
        if output_file:
            with open(output_file, "w") as f:
                f.write(text + "\n")
        return text


def _human(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} "


def get_model_profile(model: torch.nn.Module, input_shape: tuple | None = None, args=(), kwargs=None,
                      print_profile: bool = True, detailed: bool = True, module_depth: int = -1,
                      top_modules: int = 1, warm_up: int = 1, output_file: str | None = None):
    """Profile one forward of `model` on `args`/`kwargs` (or a random float input of `input_shape`);
    returns (forward FLOPs, forward MACs, parameters)."""
    kwargs = kwargs or {}
    if input_shape is not None:
        args = (torch.randn(*input_shape),)
    with torch.no_grad():
        for _ in range(warm_up):
            model(*args, **kwargs)
        profiler = FlopsProfiler(model)
        profiler.start_profile()
        try:
            model(*args, **kwargs)
        finally:
            profiler.stop_profile()
    if print_profile or output_file:
        text = profiler.print_model_profile(module_depth, top_modules, detailed, output_file)
        if print_profile:
            print(text)
    return profiler.get_total_flops(), profiler.get_total_macs(), profiler.get_total_params()
