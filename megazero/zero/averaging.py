"""How the data-parallel reduction turns summed gradients into their average, as DeepSpeed's stages
do it.

Stage 0 (an all-reduce) follows DeepSpeed's `prescale_gradients` and `gradient_predivide_factor`:
with `prescale_gradients` the gradients are divided by the data-parallel size before they are
summed; without it (DeepSpeed's default) they are divided by `gradient_predivide_factor` before
and by data-parallel size / factor after, so a factor of 1 sums the raw gradients and divides the
sum. Stages 1-3 (a reduce-scatter) divide by the data-parallel size before the reduction and
refuse the two keys (DeepSpeed's stages 2-3 refuse them with reduce_scatter on; its stage 1 takes
them). The result is the average either way; what differs
is the magnitude the reduction carries (and its rounding).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GradientAveraging:
    """`prescale` and `predivide_factor` as DeepSpeed's keys; `divisor` below is what the summed
    gradients are divided by in all (the data-parallel size, unless a state says otherwise)."""

    prescale: bool = False
    predivide_factor: float = 1.0

    @classmethod
    def of(cls, zero_config) -> GradientAveraging:
        """The averaging of a ZeroConfig's stage (megazero.config hands the top-level keys down)."""
        prescale, factor = zero_config.prescale_gradients, zero_config.gradient_predivide_factor
        if zero_config.stage == 0:
            return cls(prescale, factor)
        if prescale or factor != 1.0:
            given = "'prescale_gradients': true" if prescale else f"'gradient_predivide_factor': {factor}"
            raise ValueError(f"{given} at zero_optimization.stage {zero_config.stage}: megazero's stages 1-3 divide "
                             f"the gradients by the data-parallel size before their reduce-scatter (as DeepSpeed's "
                             f"stages 2-3 must), so the key applies at stage 0 only")
        return AVERAGE_THEN_SUM

    def before(self, divisor: float) -> float:
        """What a bucket is divided by before its reduction."""
        return divisor if self.prescale else self.predivide_factor

    def after(self, divisor: float) -> float:
        """What the reduced bucket is multiplied by (1.0: nothing to do)."""
        return 1.0 if self.prescale else self.predivide_factor / divisor


SUM_THEN_AVERAGE = GradientAveraging()  # DeepSpeed's stage 0 default: sum the raw gradients, divide the sum
AVERAGE_THEN_SUM = GradientAveraging(prescale=True)  # DeepSpeed's stages 1-3: divide, then reduce-scatter
