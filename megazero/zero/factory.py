"""The one place that builds a data-parallel state: ZeRO stage x experts x offload.

    stage 0 -> ReplicatedState      stages 1, 2 -> PartitionedState      stage 3 -> ShardedState
    expert (MoE) parameters       -> ExpertParallelState (a dense and an expert state inside)
    offload_param (stage 3)       -> a ParamSwapper handed to the ShardedState
    offload_optimizer (stages 1-3)-> the state wrapped in an OffloadedState

The engine then asks only the protocol (megazero.zero.protocol), including which optimizer it
steps (`optimizer_to_step`).
"""

from __future__ import annotations

import torch

from megazero.config import EngineConfig, ZeroConfig
from megazero.model_contract import is_expert_parameter
from megazero.zero.averaging import GradientAveraging
from megazero.zero.expert_parallel import ExpertParallelState
from megazero.zero.gathering import ParameterGathering
from megazero.zero.offload import OffloadedState
from megazero.zero.param_offload import make_param_swapper
from megazero.zero.partitioned import PartitionedState
from megazero.zero.protocol import DataParallelState, PartitionedMasters
from megazero.zero.replicated import ReplicatedState
from megazero.zero.sharded import ShardedState


def build_data_parallel_state(config: EngineConfig, model: torch.nn.Module, groups: list[list[torch.nn.Parameter]],
                              dp_group, isolate: list[torch.nn.Parameter] = (), ep_group=None,
                              expert_dp_group=None) -> DataParallelState:
    """The state for `config.zero_optimization` over the optimizer's param groups (model
    parameters), over the data-parallel group `dp_group` (None: the whole world).

    `isolate`: parameters (tied weights) whose reduced gradients are later summed with another
    stage's copy; stages 1-2 give each its own layout so the partitions line up. A model with
    expert parameters (`megazero_expert`) gets an ExpertParallelState: its dense parameters over
    `dp_group`, its experts over `expert_dp_group` (the EP group `ep_group`; None: EP = 1)."""
    zero = config.zero_optimization
    if any(is_expert_parameter(p) for g in groups for p in g):
        return _expert_parallel(zero, model, groups, dp_group, ep_group, expert_dp_group, isolate)
    if zero.stage == 3:
        param_swap = make_param_swapper(config, model, dp_group)
        state = ShardedState(model, groups, dp_group, zero.stage3_param_persistence_threshold,
                             zero.stage3_prefetch_bucket_size, zero.reduce_bucket_size, zero.overlap_comm,
                             zero.stage3_module_granularity_threshold, param_swap,
                             defer_masters=param_swap is not None and zero.offload_optimizer.device == "nvme",
                             swap_grads=zero.offload_optimizer.device == "nvme", averaging=GradientAveraging.of(zero))
    else:
        state = _in_memory(zero, groups, dp_group, isolate)
    return _offloaded(config, state, dp_group) if zero.stage > 0 else state


def _in_memory(zero: ZeroConfig, groups: list[list[torch.nn.Parameter]], group, isolate: list[torch.nn.Parameter],
               grad_divisor: int | None = None) -> ReplicatedState | PartitionedState:
    """Stage 0, 1 or 2 over `groups` on `group` (grad_divisor: what the summed gradients are
    divided by; None: the group's size)."""
    averaging = GradientAveraging.of(zero)
    if zero.stage == 0:
        return ReplicatedState(groups, group, zero.reduce_bucket_size, zero.overlap_comm, grad_divisor=grad_divisor,
                               averaging=averaging)
    return PartitionedState(groups, group, zero.reduce_bucket_size, zero.overlap_comm, zero.stage, isolate,
                            grad_divisor=grad_divisor, averaging=averaging, gathering=ParameterGathering.of(zero))


def _expert_parallel(zero: ZeroConfig, model: torch.nn.Module, groups: list[list[torch.nn.Parameter]], dp_group,
                     ep_group, expert_dp_group, isolate: list[torch.nn.Parameter]) -> ExpertParallelState:
    """The state of a model with expert parameters; ValueError for what expert parallelism does not
    support, naming the first expert parameter."""
    first = next(name for name, p in model.named_parameters() if is_expert_parameter(p))
    if zero.stage == 3:
        raise ValueError(f"zero_optimization.stage 3 with expert parameters (the first: {first}) is not supported: "
                         f"ZeRO-3 partitions every parameter over the whole data-parallel group, but an expert "
                         f"parameter holds different experts on each expert-parallel rank; use stage 0, 1 or 2")
    if zero.offload_optimizer.device != "none":
        raise ValueError(f"zero_optimization.offload_optimizer with expert parameters (the first: {first}) is not "
                         f"supported; set offload_optimizer.device to none")
    return ExpertParallelState(groups, zero.stage, dp_group, ep_group, expert_dp_group,
                               lambda params, group, divisor, tied: _in_memory(zero, params, group, tied, divisor),
                               isolate)


def _offloaded(config: EngineConfig, state: PartitionedMasters, group) -> DataParallelState:
    """`state` wrapped for `zero_optimization.offload_optimizer`; unchanged for device none, or cpu
    with the masters on the CPU (the in-memory path itself)."""
    zero = config.zero_optimization
    offload = zero.offload_optimizer
    if offload.device == "none":
        return state
    on_gpu = any(m.device.type != "cpu" for part in state.parts for m in part.masters)
    if offload.device == "cpu" and not on_gpu:
        return state
    return OffloadedState(state, offload.device, offload.nvme_path, zero.sub_group_size, offload.buffer_count,
                          offload.pin_memory, config.aio.model_dump(), group)
