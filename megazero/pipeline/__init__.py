"""Pipeline parallelism: layer partitioning, p2p exchange, the 1F1B schedule."""

from megazero.pipeline.p2p import StageLinks
from megazero.pipeline.partition import balanced_stage_layers
from megazero.pipeline.schedule import bubble_fraction, one_f_one_b

__all__ = ["StageLinks", "balanced_stage_layers", "bubble_fraction", "one_f_one_b"]
