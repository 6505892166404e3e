"""Dropout streams keyed by (seed, step, micro-batch, stage, TP rank): what a forward draws depends
on those coordinates only, and the process's own generators are left as they were."""

from __future__ import annotations

import torch

from megazero.tensor_parallel.random import MODEL_PARALLEL_RNG, MicroBatchStreams, get_rng_tracker, stream_seed
from models.common import count_parameters
from models.gpt import GPT, GPTConfig


def _draw(streams: MicroBatchStreams, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    with streams.micro_batch(step, index):
        default = torch.rand(8)
        with get_rng_tracker().fork():
            tracker = torch.rand(8)
    return default, tracker


def test_stream_seeds_depend_on_every_coordinate():
    assert stream_seed(1, 2, 3) == stream_seed(1, 2, 3) < 2**63
    seeds = {stream_seed(seed, kind, step, index) for seed in (0, 1) for kind in (1, 2) for step in range(4)
             for index in range(4)}
    assert len(seeds) == 2 * 2 * 4 * 4
    assert stream_seed(0, 1, 2) != stream_seed(0, 2, 1)  # order matters


def test_draws_are_a_function_of_the_coordinates_only():
    get_rng_tracker().reset()
    torch.manual_seed(0)
    streams = MicroBatchStreams(1234, pp_rank=0, tp_rank=0, tp_size=2)
    first = _draw(streams, 5, 1)
    torch.rand(100)  # whatever else consumed random numbers in between
    again = _draw(MicroBatchStreams(1234, pp_rank=0, tp_rank=0, tp_size=2), 5, 1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    for other in (_draw(streams, 6, 1), _draw(streams, 5, 0), _draw(MicroBatchStreams(1234, 1, 0, 2), 5, 1),
                  _draw(MicroBatchStreams(99, 0, 0, 2), 5, 1)):
        assert not torch.equal(other[0], first[0]) and not torch.equal(other[1], first[1])
    peer = _draw(MicroBatchStreams(1234, pp_rank=0, tp_rank=1, tp_size=2), 5, 1)
    assert torch.equal(peer[0], first[0]), "activations every TP rank holds whole: the same masks"
    assert not torch.equal(peer[1], first[1]), "inside the tensor-parallel region: per-rank masks"


def test_the_process_generators_are_left_as_they_were():
    get_rng_tracker().reset()
    get_rng_tracker().add(MODEL_PARALLEL_RNG, 7)
    torch.manual_seed(3)
    expected = torch.rand(4)
    tracker_before = get_rng_tracker().get_states()
    torch.manual_seed(3)
    _draw(MicroBatchStreams(1, tp_size=2), 0, 0)
    assert torch.equal(torch.rand(4), expected)
    assert all(torch.equal(tracker_before[k], v) for k, v in get_rng_tracker().get_states().items())
    get_rng_tracker().reset()


def test_without_tensor_parallelism_the_tracker_is_not_used():
    """A tracker state left by an earlier TP engine in the same process must not feed a TP=1 forward."""
    get_rng_tracker().reset()
    get_rng_tracker().add(MODEL_PARALLEL_RNG, 7)
    stale = _draw(MicroBatchStreams(1), 0, 0)
    get_rng_tracker().reset()
    clean = _draw(MicroBatchStreams(1), 0, 0)
    assert torch.equal(stale[1], clean[1])
    assert not torch.equal(clean[0], clean[1]), "TP=1: the attention draws continue the default stream"


def test_counting_parameters_consumes_no_random_numbers():
    """The recipe counts parameters after restoring a checkpoint's RNG states (issue 12's resume drift)."""
    torch.manual_seed(0)
    state = torch.get_rng_state()
    count_parameters(GPT, GPTConfig(vocab_size=64, seq_length=8, num_layers=1, hidden_size=16, num_attention_heads=2))
    assert torch.equal(torch.get_rng_state(), state)
