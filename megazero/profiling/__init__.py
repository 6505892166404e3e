"""Timers and throughput/MFU arithmetic."""

from megazero.profiling.throughput import gpt_flops_per_token, measure_peak_flops
from megazero.profiling.timers import Timers

__all__ = ["Timers", "gpt_flops_per_token", "measure_peak_flops"]
