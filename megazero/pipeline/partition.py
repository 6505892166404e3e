"""Which layers each pipeline stage holds: contiguous ranges balanced by a weight per layer plus the
first and last stages' extra work. PARTITION_METHODS names the weights models/parallelize.py offers:
"parameters" (the default, DeepSpeed PipelineModule's partition_method="parameters") and "compute"
(forward FLOPs, as Megatron-LM's account_for_embedding/loss_in_pipeline_split: the last stage's
output layer and loss over the vocabulary count as the compute they cost, the first stage's
embedding lookup as none)."""

from __future__ import annotations

PARTITION_METHODS = ("parameters", "compute")


def layer_forward_flops(hidden: int, seq: int, linear_params: int) -> int:
    """Forward FLOPs of one transformer layer on one sequence: 2 per weight of its linears per
    token, plus the attention core (scores and weighted sum: 2 x 2 x seq^2 x hidden)."""
    return 2 * linear_params * seq + 4 * hidden * seq * seq


def head_forward_flops(hidden: int, seq: int, vocab: int, extra_linear_params: int = 0) -> int:
    """Forward FLOPs of the output layer over the vocabulary (2 x hidden x vocab per token), its
    softmax cross-entropy (~5 per logit) and any other head linears, on one sequence."""
    return (2 * (hidden * vocab + extra_linear_params) + 5 * vocab) * seq


def balanced_stage_layers(layer_weights: list[int], num_stages: int, first_extra: int = 0,
                          last_extra: int = 0) -> list[range]:
    """Split layers 0..L-1 into `num_stages` contiguous, non-empty ranges minimising the largest
    stage's weight, where the first stage also carries `first_extra` (embeddings) and the last
    `last_extra` (final norm and head). Exact (dynamic programming over split points)."""
    n = len(layer_weights)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} pipeline stages (each needs a layer)")
    prefix = [0]
    for w in layer_weights:
        prefix.append(prefix[-1] + w)

    def cost(stage: int, lo: int, hi: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == num_stages - 1 else 0)
        return prefix[hi] - prefix[lo] + extra

    inf = float("inf")
    # best[s][i]: minimal largest weight placing layers [0, i) on stages 0..s-1
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    split = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], split[s][i] = value, j
    bounds, i = [], n
    for s in range(num_stages, 0, -1):
        bounds.append((split[s][i], i))
        i = split[s][i]
    return [range(lo, hi) for lo, hi in reversed(bounds)]
