"""Mixture of experts with expert parallelism: router, capacity, all-to-all dispatch, grouped experts."""

from megazero.moe.capacity import DispatchPlan, expert_capacity, plan_dispatch
from megazero.moe.experts import GroupedExperts, expert_slice, merge_expert_slices
from megazero.moe.layer import MoEConfig, MoELayer, moe_aux_loss, moe_stats
from megazero.moe.router import Router, Routing, load_balancing_loss, z_loss

__all__ = ["MoEConfig", "MoELayer", "moe_aux_loss", "moe_stats", "Router", "Routing", "load_balancing_loss", "z_loss",
           "GroupedExperts", "expert_slice", "merge_expert_slices", "DispatchPlan", "expert_capacity", "plan_dispatch"]
