"""The MoE router: a linear gate scoring every expert per token, top-k selection, and the router's
auxiliary losses.

All routing math is fp32 (the gate's matmul included), whatever the activations' dtype, so the
choice of experts does not depend on the precision of the run. The choice is deterministic given
the inputs: experts are ranked with a stable sort, so ties go to the lower expert index.

Score order (`score_order`):
    "softmax_topk"   probs = softmax(logits) over all experts, then the k largest (weights not
                     renormalised; Switch / GShard / Megatron's pre-softmax)
    "topk_softmax"   the k largest logits, then softmax over those k (the weights sum to one;
                     equals Mixtral's softmax -> top-k -> renormalise)

Auxiliary losses, over the tokens of the statistics passed in (see `load_balancing_loss`):
    load balancing (Switch, GShard):  E * sum_e f_e * P_e, with f_e the fraction of the T*k routing
        assignments that chose expert e (before dropping) and P_e the mean over the T tokens of
        softmax(logits)[e]; 1 when the load and the probabilities are uniform
    router z-loss (ST-MoE):           mean over tokens of logsumexp(logits)^2
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

SCORE_ORDERS = ("softmax_topk", "topk_softmax")


@dataclass
class Routing:
    """One router call on T tokens: `weights` [T, k] (fp32, the combine weights), `experts` [T, k]
    (global expert indices, distinct within a row, in descending score order), `logits` [T, E] and
    `probs` [T, E] (fp32 softmax over all experts: the load-balancing loss's P)."""

    weights: torch.Tensor
    experts: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor


class Router(nn.Module):
    """Linear gate hidden -> num_experts (no bias), top-k with k in {1, 2}. Its weight `weight`
    [num_experts, hidden] is an ordinary replicated parameter (every EP rank holds all of it)."""

    def __init__(self, hidden_size: int, num_experts: int, topk: int, score_order: str = "softmax_topk",
                 init_std: float = 0.02):
        super().__init__()
        if topk not in (1, 2):
            raise ValueError(f"router topk must be 1 or 2, got {topk}")
        if topk > num_experts:
            raise ValueError(f"router topk {topk} is larger than num_experts {num_experts}")
        if score_order not in SCORE_ORDERS:
            raise ValueError(f"score_order must be one of {SCORE_ORDERS}, got {score_order!r}")
        self.num_experts, self.topk, self.score_order = num_experts, topk, score_order
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        with torch.no_grad():
            nn.init.normal_(self.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route tokens x [T, hidden]."""
        logits = F.linear(x.float(), self.weight.float())  # fp32 routing
        probs = logits.softmax(dim=-1)
        scores = probs if self.score_order == "softmax_topk" else logits
        # stable descending sort: equal scores keep index order, so ties break to the lower expert
        experts = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices[:, :self.topk]
        if self.score_order == "softmax_topk":
            weights = probs.gather(1, experts)
        else:
            weights = logits.gather(1, experts).softmax(dim=-1)
        return Routing(weights=weights, experts=experts, logits=logits, probs=probs)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, topk={self.topk}, score_order={self.score_order}"


def load_balancing_loss(probs_sum: torch.Tensor, assignments_per_expert: torch.Tensor, num_tokens: torch.Tensor,
                        topk: int) -> torch.Tensor:
    """Switch/GShard loss E * sum_e f_e P_e from sums: probs_sum [E] = sum over tokens of
    softmax(logits), assignments_per_expert [E] = routing assignments to each expert (before
    dropping), num_tokens = T. Sums, so that they can be added up over ranks first."""
    num_experts = probs_sum.shape[0]
    f = assignments_per_expert.float() / (num_tokens * topk)
    p = probs_sum / num_tokens
    return num_experts * torch.sum(f * p)


def z_loss(logsumexp_sq_sum: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """Router z-loss mean_t logsumexp(logits_t)^2 from its sum over the tokens."""
    return logsumexp_sq_sum / num_tokens
