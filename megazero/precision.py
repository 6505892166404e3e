"""The one loss scaler: static, or dynamic with hysteresis (DeepSpeed's semantics)."""

from __future__ import annotations

import torch

from megazero.config import FP16Config


class LossScaler:
    """Scales the loss before backward so fp16 gradients do not underflow.

    Static when `dynamic` is False (the scale never changes; overflows still skip the step).
    Dynamic: starts at `init_scale`; after `hysteresis` overflows the scale halves (never below
    `min_scale`); after `scale_window` steps without an overflow it doubles. With
    `consecutive_hysteresis` the hysteresis budget is refilled after every clean step, otherwise
    only when the scale grows.
    """

    def __init__(self, init_scale: float = 1.0, dynamic: bool = False, scale_window: int = 1000,
                 hysteresis: int = 2, min_scale: float = 1.0, consecutive_hysteresis: bool = False,
                 scale_factor: float = 2.0):
        self.scale = float(init_scale)
        self.dynamic = dynamic
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.scale_factor = scale_factor
        self.hysteresis_left = hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1
        self.overflow_count = 0

    @classmethod
    def from_config(cls, fp16: FP16Config) -> LossScaler:
        """The scaler an engine uses: dynamic for fp16 with loss_scale 0, else static (1.0 off fp16)."""
        if not fp16.enabled:
            return cls(1.0, dynamic=False)
        if fp16.loss_scale > 0:
            return cls(fp16.loss_scale, dynamic=False)
        return cls(2.0 ** fp16.initial_scale_power, dynamic=True, scale_window=fp16.loss_scale_window,
                   hysteresis=fp16.hysteresis, min_scale=fp16.min_loss_scale,
                   consecutive_hysteresis=fp16.consecutive_hysteresis)

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome and adapt the scale."""
        if overflow:
            self.overflow_count += 1
        if not self.dynamic:
            self.iteration += 1
            return
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if (self.iteration - self.last_overflow_iteration) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= self.scale_factor
        self.iteration += 1

    def state_dict(self) -> dict:
        """Plain values only, so checkpoints load with weights_only=True."""
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left, "iteration": self.iteration,
                "last_overflow_iteration": self.last_overflow_iteration, "overflow_count": self.overflow_count}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned."""
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
        self.overflow_count = int(state["overflow_count"])


class MasterParams:
    """The fp32 weights the optimizer updates: copies of a 16-bit model's parameters, or the fp32
    model's own parameters (no copy)."""

    def __init__(self, model_params: list[torch.nn.Parameter]):
        self.model_params = [p for p in model_params if p.requires_grad]
        self.separate = any(p.dtype != torch.float32 for p in self.model_params)
        if self.separate:
            self.params = [torch.nn.Parameter(p.detach().float().clone()) for p in self.model_params]
        else:
            self.params = list(self.model_params)
        self._master_of = {id(p): m for p, m in zip(self.model_params, self.params)}

    def master_of(self, model_param: torch.nn.Parameter) -> torch.nn.Parameter:
        """The master weight that stands for `model_param` in the optimizer."""
        try:
            return self._master_of[id(model_param)]
        except KeyError:
            raise ValueError("the optimizer holds a tensor that is not a trainable parameter of the model "
                             f"(shape {tuple(model_param.shape)})") from None

    def attach_grads(self, grads) -> None:
        """Give each master weight its fp32 gradient (a view into the gradient buffer)."""
        for master, param in zip(self.params, self.model_params):
            master.grad = grads.grad(param)

    def detach_grads(self) -> None:
        """Drop the gradient views, so autograd's next gradients reach the buffer hooks fresh."""
        for master in self.params:
            master.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Write the (rounded) master weights into the 16-bit model."""
        if self.separate:
            torch._foreach_copy_(self.model_params, self.params)

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Reset the master weights from the model (e.g. after loading a model-only checkpoint)."""
        if self.separate:
            torch._foreach_copy_(self.params, [p.float() for p in self.model_params])


def cast_floating(value, dtype: torch.dtype):
    """`value` with every floating-point tensor in it, through lists, tuples and dicts, cast to `dtype`
    (fp16.auto_cast: DeepSpeed casts the forward's inputs so; integer tensors such as token ids stay)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        cast = [cast_floating(v, dtype) for v in value]
        return type(value)(*cast) if hasattr(value, "_fields") else type(value)(cast)
    if isinstance(value, dict):
        return type(value)((k, cast_floating(v, dtype)) for k, v in value.items())
    return value
