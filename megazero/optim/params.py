"""The `optimizer.params` schema of each built-in optimizer: DeepSpeed's keys, defaults and bounds.

The registry (`megazero.optim.registry`) pairs each model with its implementations; the config
validates `optimizer.params` against it, and the builder passes on only the keys the user gave.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from megazero.config_fields import Betas, Bool, Float, Section, config_error


class _MomentsParams(Section):
    """What Adam, AdamW and Lamb share: Adam's two moments and decoupled weight decay."""

    lr: Float = Field(1e-3, ge=0, description="learning rate")
    betas: Betas = Field((0.9, 0.999), description="decay rates of the first and second moments")
    eps: Float = Field(1e-8, ge=0, description="added to the second moment's square root")
    weight_decay: Float = Field(0.0, ge=0, description="decoupled weight decay (DeepSpeed's default 0; Lamb: "
                                                       "inside the trust ratio)")


class AdamWParams(_MomentsParams):
    """AdamW: Adam with decoupled weight decay."""

    torch_adam: Bool = Field(False, description="use torch's optimizer instead of megazero's fused op")
    amsgrad: Bool = Field(False, description="AMSGrad's running maximum of the second moment (torch's optimizer)")
    bias_correction: Bool = Field(True, description="divide the moments by 1 - beta**step (false: the raw moments, "
                                                   "as DeepSpeed's Adam; not with amsgrad)")

    @model_validator(mode="after")
    def _amsgrad_corrects(self) -> AdamWParams:
        if self.amsgrad and not self.bias_correction:
            raise config_error("'{where}bias_correction' false with '{where}amsgrad' true is not supported "
                               "(torch's AMSGrad always corrects the bias)", "bias_correction")
        return self


class AdamParams(AdamWParams):
    """Adam; `adam_w_mode` true (DeepSpeed's default) makes it AdamW."""

    adam_w_mode: Bool = Field(True, description="decoupled weight decay (AdamW); false: L2 added to the gradient")


class SGDParams(Section):
    """SGD with optional momentum (torch.optim.SGD)."""

    lr: Float = Field(1e-3, ge=0, description="learning rate")
    momentum: Float = Field(0.0, ge=0, description="momentum factor")
    dampening: Float = Field(0.0, ge=0, description="dampening of the momentum")
    weight_decay: Float = Field(0.0, ge=0, description="L2 penalty added to the gradient")
    nesterov: Bool = Field(False, description="Nesterov momentum (needs momentum > 0 and dampening 0)")

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDParams:
        # torch.optim.SGD raises the same only when the optimizer is built; the config says it first
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise config_error(f"'{{path}}' true needs '{{where}}momentum' > 0 and '{{where}}dampening' 0, got "
                               f"momentum {self.momentum}, dampening {self.dampening}", "nesterov")
        return self


class LambParams(_MomentsParams):
    """LAMB: Adam's update scaled per tensor by the trust ratio ||w|| / ||update||, clamped."""

    bias_correction: Bool = Field(True, description="Adam's bias correction of the moments")
    max_coeff: Float = Field(10.0, gt=0, description="upper clamp of the trust ratio")
    min_coeff: Float = Field(0.01, ge=0, description="lower clamp of the trust ratio")
    torch_adam: Bool = Field(False, description="use the pure-torch implementation instead of the fused op")


class AdagradParams(Section):
    """Adagrad (torch.optim.Adagrad's meaning)."""

    lr: Float = Field(1e-2, ge=0, description="learning rate")
    lr_decay: Float = Field(0.0, ge=0, description="learning-rate decay per step")
    eps: Float = Field(1e-10, ge=0, description="added to the accumulator's square root")
    weight_decay: Float = Field(0.0, ge=0, description="L2 penalty added to the gradient")
    initial_accumulator_value: Float = Field(0.0, ge=0, description="starting value of the squared-gradient sum")
    torch_adam: Bool = Field(False, description="use torch's optimizer instead of megazero's fused op")
