"""Mixture of experts with expert parallelism: router, capacity, all-to-all dispatch, grouped experts."""

from megazero.moe.aux_loss import attach_aux_loss, aux_loss_gradient_scale
from megazero.moe.capacity import DispatchPlan, expert_capacity, plan_dispatch
from megazero.moe.experts import GroupedExperts, expert_slice, merge_expert_slices
from megazero.moe.layer import MoEConfig, MoELayer, attached_aux_loss, has_moe_layers, moe_aux_loss, moe_stats
from megazero.moe.router import Router, Routing, load_balancing_loss, z_loss

__all__ = ["MoEConfig", "MoELayer", "moe_aux_loss", "moe_stats", "attached_aux_loss", "has_moe_layers",
           "attach_aux_loss", "aux_loss_gradient_scale", "Router", "Routing", "load_balancing_loss", "z_loss",
           "GroupedExperts", "expert_slice", "merge_expert_slices", "DispatchPlan", "expert_capacity", "plan_dispatch"]
