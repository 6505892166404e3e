"""ZeRO: data-parallel states that replicate (stage 0) or partition (stages 1-3) model states.

Start with README.md in this folder: its layers, reading order and glossary.
"""

from __future__ import annotations

from megazero.model_contract import is_expert_parameter
from megazero.zero.expert_parallel import ExpertParallelState
from megazero.zero.factory import build_data_parallel_state
from megazero.zero.init import GatheredParameters, Init
from megazero.zero.partitioned import PartitionedState
from megazero.zero.protocol import DataParallelState
from megazero.zero.replicated import ReplicatedState
from megazero.zero.sharded import ShardedState

__all__ = ["build_data_parallel_state", "ExpertParallelState", "is_expert_parameter", "DataParallelState",
           "GatheredParameters", "Init", "PartitionedState", "ReplicatedState", "ShardedState"]
