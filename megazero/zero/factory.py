"""The one place that builds a data-parallel state: ZeRO stage x experts x offload.

    stage 0 -> ReplicatedState      stages 1, 2 -> PartitionedState      stage 3 -> ShardedState
    expert (MoE) parameters       -> ExpertParallelState (a dense and an expert state inside, each
                                     of the stage and offloaded as above)
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
from megazero.zero.unit_hooks import UnitHooks


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
        return _expert_parallel(config, model, groups, dp_group, ep_group, expert_dp_group, isolate)
    state = _sharded(config, model, groups, dp_group) if zero.stage == 3 else _in_memory(zero, groups, dp_group,
                                                                                           isolate)
    return _offloaded(config, state, dp_group) if zero.stage > 0 else state


def _sharded(config: EngineConfig, model: torch.nn.Module, groups: list[list[torch.nn.Parameter]], group,
             grad_divisor: int | None = None, install_hooks: bool = True) -> ShardedState:
    """Stage 3 over `groups` on `group`, its partitions in swap files with `offload_param`."""
    zero = config.zero_optimization
    param_swap = make_param_swapper(config, model, group)
    return ShardedState(model, groups, group, zero.stage3_param_persistence_threshold,
                        zero.stage3_prefetch_bucket_size, zero.reduce_bucket_size, zero.overlap_comm,
                        zero.stage3_module_granularity_threshold, param_swap,
                        defer_masters=param_swap is not None and zero.offload_optimizer.device == "nvme",
                        swap_grads=zero.offload_optimizer.device == "nvme", averaging=GradientAveraging.of(zero),
                        grad_divisor=grad_divisor, install_hooks=install_hooks)


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


def _expert_parallel(config: EngineConfig, model: torch.nn.Module, groups: list[list[torch.nn.Parameter]],
                     dp_group, ep_group, expert_dp_group, isolate: list[torch.nn.Parameter]) -> ExpertParallelState:
    """The state of a model with expert parameters: a dense and an expert state of the configured
    stage, each offloaded on its own; at stage 3 one UnitHooks over both states' units."""
    zero = config.zero_optimization
    sharded: list[ShardedState] = []

    def build(params, group, divisor, tied):
        if zero.stage == 3:
            inner = _sharded(config, model, params, group, divisor, install_hooks=False)
            sharded.append(inner)
        else:
            inner = _in_memory(zero, params, group, tied, divisor)
        return _offloaded(config, inner, group) if zero.stage > 0 else inner

    state = ExpertParallelState(groups, zero.stage, dp_group, ep_group, expert_dp_group, build, isolate)
    if sharded:
        UnitHooks(model, [unit for s in sharded for unit in s.units])
    return state


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
