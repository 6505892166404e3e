"""Which layers each pipeline stage holds: contiguous ranges balanced by a weight per layer plus the
first and last stages' extra work. PARTITION_METHODS names the weights models/parallelize.py offers:
"parameters" (the default, DeepSpeed PipelineModule's partition_method="parameters"), "compute"
(forward FLOPs, as Megatron-LM's account_for_embedding/loss_in_pipeline_split: the last stage's
output layer and loss over the vocabulary count as the compute they cost, the first stage's
embedding lookup as none) and "measured" (the forward + backward time of a layer, of the
embeddings and of the head and loss, timed at build time: megazero.pipeline.stage_timing).

With v > 1 model chunks per stage the compute and measured splits balance each rank's total (the
sum over its chunks: that is what the steady 1F1B phase waits on), then the chunks within a rank
(balanced_interleaved_layers); the parameter split balances each virtual stage alone."""

from __future__ import annotations

PARTITION_METHODS = ("parameters", "compute", "measured")


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


def _water_fill(counts: list[int], extras: list[int], weight: int, layers: int) -> list[int]:
    """Add `layers` layers of `weight` one at a time to the part of lowest total (counts x weight +
    extras; ties: the lowest index): with equal increments this minimises the largest total."""
    counts = list(counts)
    for _ in range(layers):
        low = min(range(len(counts)), key=lambda i: (counts[i] * weight + extras[i], i))
        counts[low] += 1
    return counts


def balanced_interleaved_layers(layer_weights: list[int], num_stages: int, num_chunks: int, first_extra: int = 0,
                                last_extra: int = 0) -> list[range]:
    """Layers of the p x v virtual stages (virtual stage c * p + s is chunk c of rank s) for the
    interleaved schedule: each rank's total (its chunks' layers plus the first virtual stage's
    `first_extra` on rank 0 and the last one's `last_extra` on rank p - 1) as even as the layers
    allow, then each rank's layers over its chunks so that its largest chunk is smallest. Every
    chunk keeps a layer. Exact for equal layer weights (water-filling in whole layers); with unequal
    ones (MoE layers every few) it balances each virtual stage alone, as balanced_stage_layers."""
    n, p, v = len(layer_weights), num_stages, num_chunks
    if v == 1 or len(set(layer_weights)) > 1:
        return balanced_stage_layers(layer_weights, p * v, first_extra, last_extra)
    if n < p * v:
        raise ValueError(f"cannot split {n} layers into {p} x {v} virtual pipeline stages (each needs a layer)")
    weight = layer_weights[0]
    rank_extras = [0] * p
    rank_extras[0] += first_extra
    rank_extras[p - 1] += last_extra
    per_rank = _water_fill([v] * p, rank_extras, weight, n - p * v)
    counts = {}
    for s in range(p):
        extras = [(first_extra if (s, c) == (0, 0) else 0) + (last_extra if (s, c) == (p - 1, v - 1) else 0)
                  for c in range(v)]
        for c, count in enumerate(_water_fill([1] * v, extras, weight, per_rank[s] - v)):
            counts[c * p + s] = count
    ranges, start = [], 0
    for k in range(p * v):
        ranges.append(range(start, start + counts[k]))
        start += counts[k]
    return ranges
