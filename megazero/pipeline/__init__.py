"""Pipeline parallelism: layer partitioning, p2p exchange, the 1F1B schedules (plain and interleaved),
generation from a pipelined model."""

from megazero.pipeline.chunks import ModelChunks, model_chunks
from megazero.pipeline.generation import pipelined_generate
from megazero.pipeline.interleaved import interleaved_bubble_fraction, interleaved_one_f_one_b
from megazero.pipeline.p2p import StageLinks
from megazero.pipeline.partition import balanced_stage_layers
from megazero.pipeline.schedule import bubble_fraction, one_f_one_b

__all__ = ["ModelChunks", "StageLinks", "balanced_stage_layers", "bubble_fraction", "interleaved_bubble_fraction",
           "interleaved_one_f_one_b", "model_chunks", "one_f_one_b", "pipelined_generate"]
