"""Which layers each pipeline stage holds: contiguous ranges balanced by parameter count."""

from __future__ import annotations


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
