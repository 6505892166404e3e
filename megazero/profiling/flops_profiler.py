"""FLOPs profiler: parameters, MACs, FLOPs, latency and FLOP/s per module, from one forward pass
(DeepSpeed's `FlopsProfiler` and `get_model_profile`, with its arguments and return values).

While profiling, the torch functions that do the arithmetic are wrapped to count their work, and
module hooks attribute it to the module that is running (a module's counts include its children).
Counting rules, DeepSpeed's unless marked (one multiply-add = one MAC = two FLOPs):
- linear: (input elements / in_features) x in x out MACs, plus one FLOP per output for the bias
  (DeepSpeed counts no bias for linear, only for conv); a RowParallelLinear adds its bias after the
  reduction, outside F.linear: counted the same way (megazero's);
- conv1d/2d/3d: output elements x (in_channels / groups) x kernel size MACs, plus one FLOP per
  output for the bias;
- matmul / mm / bmm (functions and Tensor methods) and `@`: output elements x the contracted size
  MACs (DeepSpeed multiplies the first operand's elements by the last size, which undercounts a
  broadcast first operand, and misses `@`); addmm / baddbmm: the same plus one FLOP per element of
  the added input;
- scaled_dot_product_attention (megazero's; DeepSpeed does not count it): B H Lq Lk E (scores) +
  B H Lq Lk Ev (weighted values) MACs, plus one FLOP per score for the softmax (the full matrix
  also when causal), as the matmul + softmax it replaces would count;
- layer_norm, group_norm, instance_norm: 5 FLOPs per element with affine weights, else 4;
  batch_norm: the same in training, 2 (affine) or 1 in eval;
- softmax, relu, leaky_relu, elu, gelu, silu, and every max / avg / adaptive pooling: 1 FLOP per
  input element, no MACs; tanh and sigmoid too (megazero's: DeepSpeed does not count them);
- not counted (as in DeepSpeed): embeddings, dropout, the `+ - * /` operators, losses. DeepSpeed
  also counts torch.add / torch.mul / einsum calls; megazero does not.
The backward pass is reported as twice the forward (two matmuls per forward matmul).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazero.tensor_parallel.layers import RowParallelLinear


def _numel(t) -> int:
    return t.numel() if isinstance(t, torch.Tensor) else 0


def _arg(args, kwargs, index: int, name: str):
    return args[index] if len(args) > index else kwargs.get(name)


def _linear(args, kwargs, out):
    x, w = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
    macs = x.numel() // w.shape[-1] * w.shape[-1] * w.shape[0]
    return 2 * macs + (_numel(out) if _arg(args, kwargs, 2, "bias") is not None else 0), macs


def _conv(args, kwargs, out):
    w = _arg(args, kwargs, 1, "weight")
    macs = out.numel() * w.shape[1] * math.prod(w.shape[2:])  # w: out, in / groups, *kernel
    return 2 * macs + (out.numel() if _arg(args, kwargs, 2, "bias") is not None else 0), macs


def _matmul(args, kwargs, out):
    macs = out.numel() * args[0].shape[-1]
    return 2 * macs, macs


def _addmm(args, kwargs, out):  # addmm(input, a, b) / baddbmm(input, a, b): input + a @ b
    macs = out.numel() * args[1].shape[-1]
    return 2 * macs + _numel(args[0]), macs


def _sdpa(args, kwargs, out):
    q, k, v = (_arg(args, kwargs, i, name) for i, name in enumerate(("query", "key", "value")))
    scores = q.numel() // q.shape[-1] * k.shape[-2]  # B H Lq Lk
    macs = scores * q.shape[-1] + scores * v.shape[-1]
    return 2 * macs + scores, macs


def _norm(weight_index: int) -> Callable:
    def rule(args, kwargs, out):
        weight = _arg(args, kwargs, weight_index, "weight")
        return _arg(args, kwargs, 0, "input").numel() * (5 if weight is not None else 4), 0
    return rule


def _batch_norm(args, kwargs, out):
    affine = _arg(args, kwargs, 3, "weight") is not None
    training = bool(_arg(args, kwargs, 5, "training"))
    return args[0].numel() * ((5 if affine else 4) if training else (2 if affine else 1)), 0


def _elementwise(args, kwargs, out):
    return _numel(_arg(args, kwargs, 0, "input")), 0


_POOLS = [f"{kind}_pool{d}d" for kind in ("max", "avg", "adaptive_max", "adaptive_avg") for d in (1, 2, 3)]
_COUNTED: dict[tuple[object, str], Callable] = {
    (F, "linear"): _linear, (F, "conv1d"): _conv, (F, "conv2d"): _conv, (F, "conv3d"): _conv,
    (torch, "matmul"): _matmul, (torch, "bmm"): _matmul, (torch, "mm"): _matmul,
    (torch.Tensor, "matmul"): _matmul, (torch.Tensor, "bmm"): _matmul, (torch.Tensor, "mm"): _matmul,
    (torch.Tensor, "__matmul__"): _matmul, (torch, "addmm"): _addmm, (torch, "baddbmm"): _addmm,
    (F, "scaled_dot_product_attention"): _sdpa,
    (F, "layer_norm"): _norm(2), (F, "group_norm"): _norm(2), (F, "instance_norm"): _norm(3),
    (F, "batch_norm"): _batch_norm,
    **{(F, name): _elementwise for name in ("softmax", "relu", "leaky_relu", "elu", "gelu", "silu", *_POOLS)},
    (torch, "tanh"): _elementwise, (torch, "sigmoid"): _elementwise,
}


def _row_parallel_bias(module: RowParallelLinear, out) -> int:
    return _numel(out) if module.bias is not None else 0


# work a module does outside the wrapped functions, counted when its forward returns
_MODULE_RULES: dict[type, Callable] = {RowParallelLinear: _row_parallel_bias}


def device_synchronizer(devices) -> Callable[[], None] | None:
    """What a module's timer must call before reading the clock so that its latency covers the
    module's work, not just its kernel launches: torch.cuda.synchronize on each CUDA device among
    `devices` (CUDA runs asynchronously); None when every device is the CPU."""
    cuda = sorted({torch.device(d) for d in devices if torch.device(d).type == "cuda"},
                  key=lambda d: -1 if d.index is None else d.index)
    if not cuda:
        return None

    def synchronize() -> None:
        for device in cuda:
            torch.cuda.synchronize(device)
    return synchronize


def _model_devices(model: nn.Module) -> set[torch.device]:
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if not devices and torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = {torch.device("cuda", torch.cuda.current_device())}  # no tensors of its own: maybe its inputs'
    return devices


class _Stats:
    def __init__(self):
        self.flops = 0
        self.macs = 0
        self.latency = 0.0
        self.calls = 0


class FlopsProfiler:
    """Profile `model`: start_profile(), run a forward, stop_profile(), then read or print the results."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.flops = 0
        self.macs = 0
        self.stats: dict[nn.Module, _Stats] = {}
        self._originals: dict[tuple[object, str], Callable] = {}
        self._hooks: list = []
        self._entry: dict[int, tuple[int, int, float]] = {}
        self._ignored_depth = 0  # > 0 while an ignored module runs
        self._synchronize: Callable[[], None] | None = None  # set per profile from the model's devices
        self.active = False

    # ---- counting -----------------------------------------------------------------------------
    def _count(self, flops: int, macs: int) -> None:
        if self.active and not self._ignored_depth:
            self.flops += flops
            self.macs += macs

    def _wrap(self, fn: Callable, rule: Callable) -> Callable:
        def counted(*args, **kwargs):
            out = fn(*args, **kwargs)
            if self.active and not self._ignored_depth:
                self._count(*rule(args, kwargs, out))
            return out
        return counted

    def _clock(self) -> float:
        if self._synchronize is not None:  # the kernels queued so far belong to what came before
            self._synchronize()
        return time.perf_counter()

    def _pre(self, module, args) -> None:
        self._entry[id(module)] = (self.flops, self.macs, self._clock())

    def _post(self, module, args, out) -> None:
        rule = _MODULE_RULES.get(type(module))
        if rule is not None:
            self._count(rule(module, out), 0)
        now = self._clock()
        flops, macs, start = self._entry.pop(id(module), (self.flops, self.macs, now))
        stats = self.stats.setdefault(module, _Stats())
        stats.flops += self.flops - flops
        stats.macs += self.macs - macs
        stats.latency += now - start
        stats.calls += 1

    def _enter_ignored(self, module, args) -> None:
        self._ignored_depth += 1

    def _leave_ignored(self, module, args, out) -> None:
        self._ignored_depth -= 1

    def _hook_modules(self, ignore_list: Sequence[type]) -> None:
        """Count hooks on every module; an ignored one (a type in ignore_list) and everything under it
        only suspends counting while it runs."""
        ignored: set[nn.Module] = set()
        for module in self.model.modules():
            if type(module) in ignore_list:
                ignored.update(module.modules())
                self._hooks.append(module.register_forward_pre_hook(self._enter_ignored))
                self._hooks.append(module.register_forward_hook(self._leave_ignored))
        for module in self.model.modules():
            if module not in ignored:
                self._hooks.append(module.register_forward_pre_hook(self._pre))
                self._hooks.append(module.register_forward_hook(self._post))

    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Start counting (patches the counted torch functions and hooks every module). Modules whose
        type is in ignore_list are not profiled: their work counts nowhere."""
        ignore_list = tuple(ignore_list or ())
        bad = [t for t in ignore_list if not isinstance(t, type)]
        if bad:
            raise TypeError(f"ignore_list: expected module types (e.g. torch.nn.Linear), got {bad}")
        self.end_profile()
        for (owner, name), rule in _COUNTED.items():
            self._originals[(owner, name)] = getattr(owner, name)
            setattr(owner, name, self._wrap(getattr(owner, name), rule))
        self._hook_modules(ignore_list)
        self._synchronize = device_synchronizer(_model_devices(self.model))
        self._ignored_depth = 0
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
    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward FLOPs counted (as_string: e.g. '1.23 G', DeepSpeed's format)."""
        return number_to_string(self.flops) if as_string else self.flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Forward MACs counted (as_string: e.g. '1.23 GMACs')."""
        return macs_to_string(self.macs) if as_string else self.macs

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters of the model, a tied one counted once (as_string: e.g. '1.23 M', '1.5 B')."""
        params = sum(p.numel() for p in self.model.parameters())
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds of the root module's forward (as_string: e.g. '12.3 ms')."""
        seconds = self.stats[self.model].latency if self.model in self.stats else 0.0
        return number_to_string(seconds) + "s" if as_string else seconds

    def print_model_profile(self, module_depth: int = -1, top_modules: int = 1, detailed: bool = True,
                            output_file: str | None = None, *, profile_step: int | None = None) -> str:
        """The profile as text: totals, the top modules at each depth, and (detailed) the module tree;
        also written to output_file when given. profile_step (DeepSpeed's keyword) heads the text.
        Unlike DeepSpeed's, it returns the text rather than printing it (the engine prints on rank 0)."""
        duration = max(self.get_total_duration(), 1e-12)
        step = f"profile at step {profile_step} | " if profile_step is not None else ""
        lines = [f"{step}params: {self.get_total_params():,} | forward MACs: {macs_to_string(self.macs)} | "
                 f"forward FLOPs: {number_to_string(self.flops)} | "
                 f"backward FLOPs (2x forward): {number_to_string(2 * self.flops)} | "
                 f"forward latency: {self.get_total_duration(as_string=True)} | "
                 f"forward FLOP/s: {number_to_string(self.flops / duration)}"]
        by_depth: dict[int, list] = {}
        for name, module in self.model.named_modules():
            if module in self.stats:
                by_depth.setdefault(_depth(name), []).append((name or "(model)", module))
        for depth in sorted(by_depth):
            if module_depth >= 0 and depth > module_depth:
                break
            top = sorted(by_depth[depth], key=lambda item: -self.stats[item[1]].macs)[:top_modules]
            lines.append(f"depth {depth}: top {len(top)} by MACs: "
                         + ", ".join(f"{name} {macs_to_string(self.stats[m].macs)}" for name, m in top))
        if detailed:
            lines.append("module | params | MACs | FLOPs | latency | FLOP/s")
            for name, module in self.model.named_modules():
                depth = _depth(name)
                if module not in self.stats or (module_depth >= 0 and depth > module_depth):
                    continue
                s = self.stats[module]
                params = sum(p.numel() for p in module.parameters())
                lines.append(f"{'  ' * depth}{name or '(model)'} ({type(module).__name__}) | {params:,} | "
                             f"{macs_to_string(s.macs)} | {number_to_string(s.flops)} | "
                             f"{number_to_string(s.latency)}s | {number_to_string(s.flops / max(s.latency, 1e-12))}")
        text = "\n".join(lines)
        if output_file:
            with open(output_file, "w") as f:
                f.write(text + "\n")
        return text


def _depth(name: str) -> int:
    return 0 if not name else name.count(".") + 1


def number_to_string(value: float, precision: int = 2) -> str:
    """`value` with a unit prefix, as DeepSpeed prints it: 1234567 -> '1.23 M', 0.0123 -> '12.3 m'."""
    scales = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3), ("", 1.0), ("m", 1e-3))
    unit, scale = next(((u, s) for u, s in scales if abs(value) >= s), ("u", 1e-6))
    if value == 0:
        unit, scale = "", 1.0
    return f"{round(value / scale, precision):g} {unit}"


def macs_to_string(macs: float) -> str:
    """MACs as DeepSpeed prints them: '1.23 GMACs'."""
    return number_to_string(macs) + "MACs"


def params_to_string(params: float) -> str:
    """A parameter count as DeepSpeed prints it: '1.23 M', '1.5 B', '12'."""
    return number_to_string(params).replace("G", "B").strip()


def _check_profile_arguments(model, input_shape, args, kwargs, warm_up: int, mode: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    if input_shape is not None and (not isinstance(input_shape, tuple) or not input_shape):
        raise TypeError(f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}")
    if input_shape is None and not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, or args and/or kwargs for the model")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")
    if mode == "generate" and not callable(getattr(model, "generate", None)):
        raise TypeError(f"get_model_profile: mode='generate' needs model.generate(); "
                        f"{type(model).__name__} has none")
    if warm_up < 0:
        raise ValueError(f"get_model_profile: warm_up must be >= 0, got {warm_up}")


def _random_input(model: nn.Module, shape: tuple) -> torch.Tensor:
    """A float input of `shape` on the model's device, in its parameters' dtype (as DeepSpeed's)."""
    param = next(model.parameters(), None)
    if param is None or not param.is_floating_point():
        return torch.randn(*shape)
    return torch.randn(*shape, dtype=param.dtype, device=param.device)


def get_model_profile(model: nn.Module, input_shape: tuple | None = None, args: Sequence = (),
                      kwargs: dict | None = None, print_profile: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: Sequence[type] | None = None,
                      mode: str = "forward") -> tuple:
    """DeepSpeed's get_model_profile: (FLOPs, MACs, parameters) of one `model(*args, **kwargs)`
    (mode 'forward') or `model.generate(*args, **kwargs)` (mode 'generate'), after warm_up uncounted
    calls. input_shape: call the model on one random tensor of that shape instead. as_string (the
    default, as in DeepSpeed): strings such as ('1.23 G', '615.4 MMACs', '1.2 M'), else numbers.
    ignore_modules: module types whose work is not counted. print_profile: print the profile, to
    output_file instead of stdout when given; module_depth, top_modules and detailed shape it.
    Differences from DeepSpeed: the calls run under torch.no_grad() and the model's training mode is
    restored afterwards (DeepSpeed leaves it in eval mode); output_file is written also when
    print_profile is False (DeepSpeed then ignores it); a bad argument raises instead of asserting."""
    kwargs = dict(kwargs or {})
    _check_profile_arguments(model, input_shape, args, kwargs, warm_up, mode)
    if input_shape is not None:
        args = (_random_input(model, input_shape),)
    call = model if mode == "forward" else model.generate
    was_training = model.training
    model.eval()
    profiler = FlopsProfiler(model)
    try:
        with torch.no_grad():
            for _ in range(warm_up):
                call(*args, **kwargs)
            profiler.start_profile(ignore_list=ignore_modules)
            try:
                call(*args, **kwargs)
            finally:
                profiler.stop_profile()
    finally:
        model.train(was_training)
    if print_profile or output_file:
        text = profiler.print_model_profile(module_depth, top_modules, detailed, output_file)
        if print_profile and not output_file:
            print(text, file=sys.stdout, flush=True)
    return (profiler.get_total_flops(as_string), profiler.get_total_macs(as_string),
            profiler.get_total_params(as_string))
