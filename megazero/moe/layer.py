"""MoELayer: router -> capacity/dropping -> all-to-all dispatch -> grouped experts -> combine.

    y = MoELayer(config, ep_group, tp_group)(x)      # x [..., hidden] -> y [..., hidden]
    loss = loss + layer.aux_loss()                   # the weighted auxiliary losses of that forward

The layer takes its process groups as arguments: `ep_group` (the expert-parallel group: E/EP
experts here, see megazero/moe/experts.py for the parameter layout and naming; None or one rank:
all experts local), `tp_group` (tensor parallelism inside the experts; None: none) and
`stats_group` (whose tokens the auxiliary losses and statistics cover; None: the EP group's; under
context parallelism the group holding whole sequences, see the models' moe_stats_group). The
router's weight is an ordinary replicated parameter; the experts' parameters carry
`megazero_expert = True` (their gradients are reduced over the expert-data-parallel group).

Auxiliary losses and statistics are left on the layer after each forward (one clean place for
the model to add them and for the trainer to log them; moe_stats(model) gathers them for logging):
    last_aux_losses  {"load_balancing": coeff * Switch loss, "z_loss": coeff * router z-loss},
                     scalar tensors in the autograd graph; aux_loss() is their sum
    last_stats       {"dropped_fraction", "tokens_per_expert_min", "tokens_per_expert_max"},
                     detached scalars (routed assignments per expert, before dropping)
Both are over the tokens of the whole stats group (the statistics are summed over it, with the
gradients summed back in backward: megazero/moe/comm.py): every rank of it gets the same values,
the values of the single process on the concatenated batch. Each rank adds them to its loss,
and the data-parallel average of the ranks' losses is then the single-process loss.

With `attach_aux_loss` (how GPT and Llama build their MoE layers) a training forward attaches
aux_loss() to the layer's output (megazero/moe/aux_loss.py): it gets the main loss's gradient in
that output's backward, on whichever pipeline stage the layer is and under recomputation, and
the model adds only its value to the loss (`attached_aux_loss`).

With `sequence_parallel` (x is this TP rank's slice of the sequence, [batch, seq/TP, hidden]) the
layer gathers the sequence over `tp_group`, runs on all of it and returns this rank's slice
(megazero/moe/sequence.py: why this design, and the gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from megazero.distributed import all_reduce_values
from megazero.moe.aux_loss import attach_aux_loss
from megazero.moe.capacity import plan_dispatch
from megazero.moe.comm import all_gather_counts, all_reduce_sum, group_rank
from megazero.moe.dispatch import combine, dispatch
from megazero.moe.experts import GroupedExperts
from megazero.moe.router import Router, load_balancing_loss, z_loss
from megazero.moe.sequence import gather_sequence, split_sequence


@dataclass
class MoEConfig:
    """Shape and routing of one MoE layer (Megatron's flag in brackets)."""

    hidden_size: int
    ffn_hidden_size: int  # of each expert
    num_experts: int  # [--num-experts]
    router_topk: int = 2  # 1 or 2 [--moe-router-topk]
    capacity_factor: float | None = None  # None: dropless [--moe-capacity-factor]
    aux_loss_coeff: float = 0.01  # load-balancing loss weight [--moe-aux-loss-coeff]
    z_loss_coeff: float = 0.0  # router z-loss weight [--moe-z-loss-coeff]
    score_order: str = "softmax_topk"  # or "topk_softmax" (see megazero/moe/router.py)
    activation: str = "gelu"  # "gelu" (GPT: fc1, GeLU, fc2, with biases) or "swiglu" (Llama)
    init_std: float = 0.02  # router and fc1
    output_init_std: float = 0.02  # fc2 (GPT scales it by 1/sqrt(2 * layers))
    # in training, the aux losses get their gradient through the layer's output (megazero/moe/aux_loss.py),
    # so the model adds only their value to its loss (models/gpt.py, models/llama.py); False: the caller
    # adds aux_loss() to its loss itself
    attach_aux_loss: bool = False
    # x is this TP rank's slice of the sequence, [batch, seq/TP, hidden] (megazero/moe/sequence.py)
    sequence_parallel: bool = False


class MoELayer(nn.Module):
    """Mixture of experts in place of an MLP (see the module docstring)."""

    def __init__(self, config: MoEConfig, ep_group=None, tp_group=None, stats_group=None):
        super().__init__()
        self.config, self.ep_group, self.tp_group = config, ep_group, tp_group
        self.stats_group = ep_group if stats_group is None else stats_group
        self.router = Router(config.hidden_size, config.num_experts, config.router_topk, config.score_order,
                             config.init_std)
        self.experts = GroupedExperts(config.num_experts, config.hidden_size, config.ffn_hidden_size,
                                      config.activation, ep_group, tp_group, config.init_std,
                                      config.output_init_std)
        self.last_aux_losses: dict[str, torch.Tensor] = {}
        self.last_stats: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> the experts' combined output, same shape and dtype."""
        if self.config.sequence_parallel:
            x = gather_sequence(x, self.tp_group)  # every TP rank routes the whole sequence
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing = self.router(tokens)
        num_experts, topk = self.config.num_experts, self.config.router_topk
        local_counts = torch.bincount(routing.experts.reshape(-1), minlength=num_experts)
        routed = all_gather_counts(local_counts, self.ep_group)  # [EP, E]: offsets and split sizes
        plan = plan_dispatch(routing.experts, routed, group_rank(self.ep_group), self.config.capacity_factor)
        rows, state = dispatch(tokens, plan, topk, self.ep_group)
        out = self.experts(rows, state.rows_per_expert)
        y = combine(out, routing.weights, tokens.shape[0], state)
        self._record(routing.probs, routing.logits, local_counts, plan.routed, plan.kept)
        y = y.to(x.dtype).reshape(shape)
        if self.config.attach_aux_loss and self.training:
            # also under recomputation: the recomputed forward attaches them again, in its graph
            y = attach_aux_loss(y, self.aux_loss())
        if self.config.sequence_parallel:
            y = split_sequence(y, self.tp_group)
        return y

    def _record(self, probs: torch.Tensor, logits: torch.Tensor, local_counts: torch.Tensor, routed: torch.Tensor,
                kept: torch.Tensor) -> None:
        """The auxiliary losses and statistics over the whole stats group's tokens (the dropped
        fraction over the EP group's: the capacity plan's)."""
        topk, num_experts = self.config.router_topk, self.config.num_experts
        sums = all_reduce_sum(torch.cat([probs.sum(0), torch.logsumexp(logits, -1).square().sum().view(1),
                                         local_counts.to(probs.dtype)]), self.stats_group)
        per_expert = sums[num_experts + 1:].detach().round().long()  # routing assignments per expert
        sums = sums[:num_experts + 1]
        num_tokens = per_expert.sum() / topk
        self.last_aux_losses = {
            "load_balancing": self.config.aux_loss_coeff * load_balancing_loss(sums[:-1], per_expert, num_tokens,
                                                                                topk),
            "z_loss": self.config.z_loss_coeff * z_loss(sums[-1], num_tokens),
        }
        self.last_stats = {
            "dropped_fraction": (1.0 - kept.sum() / routed.sum()).float().detach(),
            "tokens_per_expert_min": per_expert.min().float(),
            "tokens_per_expert_max": per_expert.max().float(),
        }

    def aux_loss(self) -> torch.Tensor:
        """Sum of the weighted auxiliary losses of the last forward (in the autograd graph)."""
        return sum(self.last_aux_losses.values())


def moe_aux_loss(model: nn.Module) -> torch.Tensor | float:
    """Sum of the auxiliary losses of every MoELayer in `model` after its forward (0.0 without any)."""
    return sum((m.aux_loss() for m in model.modules() if isinstance(m, MoELayer) and m.last_aux_losses), 0.0)


def attached_aux_loss(model: nn.Module) -> torch.Tensor | float:
    """The value (detached) of the auxiliary losses the MoE layers of `model` with attach_aux_loss
    attached to their outputs in their last training forward: what a model adds to the value of its
    loss, and what a pipeline stage without the loss adds to the step's (0.0 without any)."""
    return sum((m.aux_loss().detach() for m in model.modules()
                if isinstance(m, MoELayer) and m.config.attach_aux_loss and m.training and m.last_aux_losses), 0.0)


def has_moe_layers(model: nn.Module) -> bool:
    """True when `model` holds an MoELayer."""
    return any(isinstance(m, MoELayer) for m in model.modules())


def moe_stats(model: nn.Module, group=None) -> dict[str, float]:
    """What a trainer logs after a forward of `model` (empty without MoE layers): the weighted
    auxiliary losses summed over the MoE layers ("load_balancing", "z_loss"), the fraction of
    routing assignments dropped (mean over the layers) and the fewest/most tokens routed to one
    expert in any layer ("tokens_per_expert_min", "tokens_per_expert_max").

    group: the pipeline-parallel group, to cover the MoE layers of every stage (a collective on
    it, every stage calls it; a stage may hold none). None: this module's layers."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer) and m.last_stats]
    # this stage's sums (both losses, the dropped fractions, the layer count), then its fewest and most tokens
    sums = [sum(m.last_aux_losses["load_balancing"].item() for m in layers),
            sum(m.last_aux_losses["z_loss"].item() for m in layers),
            sum(float(m.last_stats["dropped_fraction"]) for m in layers), float(len(layers))]
    extremes = [-min((float(m.last_stats["tokens_per_expert_min"]) for m in layers), default=math.inf),
                max((float(m.last_stats["tokens_per_expert_max"]) for m in layers), default=-math.inf)]
    if group is not None:
        sums, extremes = all_reduce_values(sums, "sum", group), all_reduce_values(extremes, "max", group)
    if not sums[3]:
        return {}
    return {"load_balancing": sums[0], "z_loss": sums[1], "dropped_fraction": sums[2] / sums[3],
            "tokens_per_expert_min": -extremes[0], "tokens_per_expert_max": extremes[1]}
