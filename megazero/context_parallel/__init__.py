"""Context parallelism: a sample's sequence split over the ranks of a context-parallel group.

    split.py        which tokens each CP rank holds (the causal load-balanced 2 x CP-chunk split)
    comm.py         the collectives as autograd functions (all-to-all, ring shift)
    ulysses.py      all-to-all attention (DeepSpeed-Ulysses): sequence-split to head-split and back
    ring.py         ring attention (Megatron-Core's p2p): KV blocks round the ring, log-sum-exp merge
"""

from megazero.context_parallel.ring import Visible, ring_attention
from megazero.context_parallel.split import gather_sequence, load_balanced_positions, split_sequence
from megazero.context_parallel.ulysses import ulysses_attention

__all__ = [
    "Visible", "gather_sequence", "load_balanced_positions", "ring_attention", "split_sequence", "ulysses_attention",
]
