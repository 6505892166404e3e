"""The tensor-parallel RNG tracker: a state is its seed plus one generator state per device kind,
each made from the seed the first time a fork draws on that kind (so a tracker seeded before CUDA
is initialised still forks the GPU's generator: the lazy path tested here on the CPU kind), and
get_states/set_states carry all of it (checkpoints, recomputation)."""

from __future__ import annotations

import pytest
import torch

from megazero.tensor_parallel.random import RNGStatesTracker


def _fresh(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_forks_continue_the_seeded_stream_and_leave_the_default_generator_alone():
    tracker = RNGStatesTracker()
    tracker.add("tp", 11)
    torch.manual_seed(3)
    expected_default = torch.rand(4, generator=_fresh(3))
    reference = _fresh(11)
    with tracker.fork("tp"):
        first = torch.rand(5)
    with tracker.fork("tp"):
        second = torch.rand(5)
    assert torch.equal(first, torch.rand(5, generator=reference))
    assert torch.equal(second, torch.rand(5, generator=reference))
    assert torch.equal(torch.rand(4), expected_default)


def test_a_kinds_state_is_made_at_its_first_fork_not_at_add():
    tracker = RNGStatesTracker()
    tracker.add("tp", 11)
    assert set(tracker.get_states()) == {"tp/seed"}  # nothing depends on what was initialised at add()
    torch.rand(7)  # the default generator moving on in between changes nothing
    with tracker.fork("tp"):
        drawn = torch.rand(3)
    assert torch.equal(drawn, torch.rand(3, generator=_fresh(11)))
    assert set(tracker.get_states()) == {"tp/seed", "tp/cpu"}


def test_states_restored_before_the_first_fork_redraw_the_same_numbers():
    """Recomputation restores the states captured at the forward: if the forward's fork made a
    kind's state, the recompute makes it again from the seed, and draws the same mask."""
    tracker = RNGStatesTracker()
    tracker.add("tp", 5)
    captured = tracker.get_states()
    with tracker.fork("tp"):
        forward = torch.rand(6)
    tracker.set_states(captured)
    with tracker.fork("tp"):
        recomputed = torch.rand(6)
    assert torch.equal(forward, recomputed)
    midway = tracker.get_states()  # after one fork: the stream goes on from here
    with tracker.fork("tp"):
        after = torch.rand(6)
    tracker.set_states(midway)
    with tracker.fork("tp"):
        assert torch.equal(torch.rand(6), after)


def test_the_older_format_of_one_cpu_state_per_name_is_accepted():
    generator = _fresh(9)
    torch.rand(4, generator=generator)
    tracker = RNGStatesTracker()
    tracker.set_states({"tp": generator.get_state()})
    with tracker.fork("tp"):
        drawn = torch.rand(3)
    assert torch.equal(drawn, torch.rand(3, generator=generator))
    assert int(tracker.get_states()["tp/seed"]) == 9


def test_unknown_names_fork_nothing_and_bad_names_are_refused():
    tracker = RNGStatesTracker()
    torch.manual_seed(1)
    with tracker.fork("absent"):
        drawn = torch.rand(2)
    assert torch.equal(drawn, torch.rand(2, generator=_fresh(1)))
    with pytest.raises(ValueError, match="may not contain '/'"):
        tracker.add("a/b", 1)
