"""RNG states for tensor parallelism (Megatron's tracker).

Dropout applied to activations every TP rank holds whole must draw the same mask on every TP
rank; dropout inside the tensor-parallel region (attention probabilities of this rank's heads)
must draw different masks per TP rank. The default generator (seeded identically on all ranks)
serves the first; the tracker holds a named extra state, seeded per TP rank, and `fork(name)`
runs a block with it swapped in. Activation checkpointing saves and restores the tracker's
states with the default ones, so recomputed dropout masks equal the original ones.
"""

from __future__ import annotations

import contextlib

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718  # Megatron's offset: the TP seeds differ from the data seed


def _device_of_default() -> str:
    return "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"


def _get_state(device: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: str) -> None:
    if device == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states, each swapped into the default generator inside fork(name)."""

    def __init__(self):
        self.states: dict[str, torch.Tensor] = {}
        self.device = "cpu"

    def reset(self) -> None:
        """Forget every state."""
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        """A new state `name` seeded with `seed` (the default generator is left as it was)."""
        self.device = _device_of_default()
        saved = _get_state(self.device)
        torch.manual_seed(seed) if self.device == "cpu" else torch.cuda.manual_seed(seed)
        self.states[name] = _get_state(self.device)
        _set_state(saved, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of all states (for checkpoints and recomputation)."""
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore states taken by get_states()."""
        self.states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block drawing random numbers from state `name` (a no-op if it was never added)."""
        if name not in self.states:
            yield
            return
        saved = _get_state(self.device)
        _set_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(saved, self.device)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (one per process, like the default generator it complements)."""
    return _TRACKER


def seed_tracker(seed: int, tp_rank: int) -> None:
    """Give the tracker its tensor-parallel state, seeded seed + 2718 + tp_rank (different per TP
    rank); the default generator is left as it is."""
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)


def model_parallel_seed(seed: int, tp_rank: int) -> None:
    """Seed the default generator with `seed` (same on all TP ranks) and the tracker (seed_tracker)."""
    torch.manual_seed(seed)
    seed_tracker(seed, tp_rank)
