"""ZeRO: data-parallel states that replicate (stage 0) or partition (stages 1-3) model states."""

from __future__ import annotations

import torch

from megazero.config import ZeroConfig
from megazero.zero.averaging import GradientAveraging
from megazero.zero.expert_parallel import ExpertParallelState, build_expert_parallel_state, is_expert_parameter
from megazero.zero.gathering import ParameterGathering
from megazero.zero.init import GatheredParameters, Init
from megazero.zero.partitioned import PartitionedState
from megazero.zero.protocol import DataParallelState
from megazero.zero.replicated import ReplicatedState
from megazero.zero.sharded import ShardedState


def build_data_parallel_state(config: ZeroConfig, model: torch.nn.Module, groups: list[list[torch.nn.Parameter]],
                              dp_group, isolate: list[torch.nn.Parameter] = (), param_swap=None, ep_group=None,
                              expert_dp_group=None) -> DataParallelState:
    """The state object (a megazero.zero.protocol.DataParallelState) for `config.stage` over the
    optimizer's param groups (model parameters).

    `isolate`: parameters (tied weights) whose reduced gradients are later summed with another
    stage's copy; stages 1-2 give each its own layout so the partitions line up. `param_swap`: stage
    3's parameter offload (megazero.zero.param_offload.make_param_swapper). A model with expert
    parameters (`megazero_expert`) gets an ExpertParallelState: its dense parameters over `dp_group`,
    its experts over `expert_dp_group` (the EP group `ep_group`; None: EP = 1), see
    megazero.zero.expert_parallel."""
    if any(is_expert_parameter(p) for g in groups for p in g):
        return build_expert_parallel_state(config, model, groups, dp_group, ep_group, expert_dp_group, isolate)
    averaging = GradientAveraging.of(config)
    if config.stage == 0:
        return ReplicatedState(groups, dp_group, config.reduce_bucket_size, config.overlap_comm, averaging=averaging)
    if config.stage == 3:
        return ShardedState(model, groups, dp_group, config.stage3_param_persistence_threshold,
                            config.stage3_prefetch_bucket_size, config.reduce_bucket_size, config.overlap_comm,
                            config.stage3_module_granularity_threshold, param_swap,
                            defer_masters=param_swap is not None and config.offload_optimizer.device == "nvme",
                            swap_grads=config.offload_optimizer.device == "nvme", averaging=averaging)
    return PartitionedState(groups, dp_group, config.reduce_bucket_size, config.overlap_comm, config.stage, isolate,
                            averaging=averaging, gathering=ParameterGathering.of(config))


__all__ = ["build_data_parallel_state", "ExpertParallelState", "is_expert_parameter", "DataParallelState",
           "Init", "GatheredParameters", "ReplicatedState",
           "PartitionedState", "ShardedState"]
