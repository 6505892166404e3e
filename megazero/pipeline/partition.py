"""Which layers each pipeline stage holds: contiguous ranges balanced by a weight per layer plus the
first and last stages' extra work. PARTITION_METHODS names the weights models/parallelize.py offers:
"parameters" (the default, DeepSpeed PipelineModule's partition_method="parameters"), "compute"
(forward FLOPs, as Megatron-LM's account_for_embedding/loss_in_pipeline_split: the last stage's
output layer and loss over the vocabulary count as the compute they cost, the first stage's
embedding lookup as none) and "measured" (the forward + backward time of a layer, of the
embeddings and of the head and loss, timed at build time: megazero.pipeline.stage_timing).

With v > 1 model chunks per stage the compute and measured splits are the ones whose interleaved
schedule simulates the shortest step (simulated_interleaved_layers, from the schedule's own order
of operations: which chunks' work meets at each exchange matters, not only each rank's total);
the parameter split balances each virtual stage alone."""

from __future__ import annotations

import math

from megazero.pipeline.schedule_simulation import simulate_interleaved

PARTITION_METHODS = ("parameters", "compute", "measured")


def layer_forward_flops(hidden: int, seq: int, linear_params: int) -> int:
    """Forward FLOPs of one transformer layer on one sequence: 2 per weight of its linears per
    token, plus the attention core (scores and weighted sum: 2 x 2 x seq^2 x hidden)."""
    return 2 * linear_params * seq + 4 * hidden * seq * seq


def head_forward_flops(seq: int, vocab: int, linear_params: int) -> int:
    """Forward FLOPs of the head on one sequence: 2 per weight of its linears (the output layer
    over the vocabulary among them) per token, and the softmax cross-entropy (~5 per logit)."""
    return (2 * linear_params + 5 * vocab) * seq


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
    return _ranges(tuple(counts[k] for k in range(p * v)))


# interleaved splits are searched exhaustively up to this many candidates (16 layers in 2 x 2
# chunks: 455), else by local search from the rank-balanced split
EXHAUSTIVE_SPLITS = 3000
# forward : backward time of a virtual stage when only their sum is known (the measured weights
# time forward + backward together): backward computes two products per forward one
BACKWARD_OVER_FORWARD = 2.0


def _ranges(counts: tuple[int, ...]) -> list[range]:
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + count)
    return [range(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def _compositions(n: int, parts: int):
    """Every way to write n as an ordered sum of `parts` positive counts (lexicographic)."""
    if parts == 1:
        yield (n,)
        return
    for first in range(1, n - parts + 2):
        for rest in _compositions(n - first, parts - 1):
            yield (first, *rest)


def simulated_interleaved_layers(layer_weights: list[int], num_stages: int, num_chunks: int, num_microbatches: int,
                                 first_extra: int = 0, last_extra: int = 0,
                                 backward_over_forward: float = BACKWARD_OVER_FORWARD) -> list[range]:
    """Layers of the p x v virtual stages (as balanced_interleaved_layers) that minimise the
    interleaved schedule's simulated step time at `num_microbatches` micro-batches
    (megazero.pipeline.schedule_simulation: the schedule's own order, a message waited for where
    it is used), a virtual stage's weight split into forward and backward as 1 : backward_over_forward.

    Why not the rank totals alone: each exchange of the steady state pairs one chunk's work on a
    rank with another chunk's on its peer, so a split with balanced totals can still make an
    exchange wait (16 GPT layers at hidden 192, the head ~2.1 layers, PP=4 x v=2, m=8: the
    rank-balanced [2, 3, 3, 1, 2, 2, 2, 1] layers simulate a 10% longer step than [1, 2, 2, 1, 3,
    3, 3, 1]; at PP=2, where each forward's output leaves before the next backward, the
    rank-balanced [4, 5, 5, 2] is the best at m=16 and within 0.3% of it at m=4 and 8).
    Exhaustive over the splits into contiguous non-empty chunks when
    there are at most EXHAUSTIVE_SPLITS of them, else a local search (moving a layer from one
    chunk to any other while that shortens the step) from balanced_interleaved_layers' split,
    which is also the first candidate: the result never simulates slower than it, and ties keep it.
    Deterministic for the same integer weights, so every rank computes the same split."""
    n, p, v = len(layer_weights), num_stages, num_chunks
    start = balanced_interleaved_layers(layer_weights, p, v, first_extra, last_extra)
    if v == 1:
        return start
    prefix = [0]
    for w in layer_weights:
        prefix.append(prefix[-1] + w)

    def step_time(counts: tuple[int, ...]) -> float:
        costs, lo = [], 0
        for k, count in enumerate(counts):
            costs.append(prefix[lo + count] - prefix[lo] + (first_extra if k == 0 else 0)
                         + (last_extra if k == p * v - 1 else 0))
            lo += count
        # in units of a forward: whole numbers for whole weights and ratios, so equal steps tie exactly
        return simulate_interleaved(num_microbatches, p, v, costs, [c * backward_over_forward for c in costs]).makespan

    best = tuple(len(r) for r in start)
    best_time = step_time(best)
    if math.comb(n - 1, p * v - 1) <= EXHAUSTIVE_SPLITS:
        for counts in _compositions(n, p * v):
            candidate_time = step_time(counts)
            if candidate_time < best_time * (1 - 1e-12):
                best, best_time = counts, candidate_time
        return _ranges(best)
    improved = True
    while improved:  # each pass strictly shortens the step: it ends
        improved = False
        for source in range(p * v):
            for target in range(p * v):  # a layer from chunk `source` to chunk `target` (the boundaries between shift)
                counts = list(best)
                counts[source], counts[target] = counts[source] - 1, counts[target] + 1
                if source == target or counts[source] < 1:
                    continue
                candidate_time = step_time(tuple(counts))
                if candidate_time < best_time * (1 - 1e-12):
                    best, best_time, improved = tuple(counts), candidate_time, True
    return _ranges(best)
