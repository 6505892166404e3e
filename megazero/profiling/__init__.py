"""Timers, throughput/MFU arithmetic, and ZeRO memory estimates and reports."""

from megazero.profiling.memory import estimate_zero_memory, paper_zero_memory
from megazero.profiling.throughput import gpt_flops_per_token, measure_peak_flops
from megazero.profiling.timers import Timers

__all__ = ["Timers", "gpt_flops_per_token", "measure_peak_flops", "estimate_zero_memory", "paper_zero_memory"]
