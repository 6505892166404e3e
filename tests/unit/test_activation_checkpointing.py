"""Activation checkpointing: gradients equal those without it, bit for bit (fp32, dropout on)."""

from __future__ import annotations

import pytest
import torch

import megazero.activation_checkpointing as ac
from megazero.tensor_parallel.random import get_rng_tracker
from models.gpt import GPT, GPTConfig
from models.parallelize import parallelize

SMALL = dict(vocab_size=256, seq_length=16, num_layers=3, hidden_size=32, num_attention_heads=4,
             make_vocab_size_divisible_by=64, dropout=0.1)


def _run(recompute: str | None, layers: int | None = None, **options) -> tuple[dict, dict]:
    """(gradients, checkpoint_stats()) of one forward/backward of the small GPT with dropout on."""
    # no tracker state left by an earlier test's TP engine in this process: attention dropout would
    # draw from it, and from where the previous run left it
    get_rng_tracker().reset()
    torch.manual_seed(0)
    model = parallelize(GPTConfig(**SMALL, recompute_granularity=recompute, recompute_num_layers=layers))
    ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    ac.configure(**options)
    try:
        torch.manual_seed(2)  # the dropout masks
        model(ids[:, :-1], ids[:, 1:]).backward()
        stats = ac.checkpoint_stats()
    finally:
        ac.configure()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, stats


def _grads(recompute: str | None, layers: int | None = None, cpu: bool = False) -> dict:
    return _run(recompute, layers, cpu_checkpointing=cpu)[0]


@pytest.mark.parametrize("recompute, layers, options", [
    ("full", None, {}), ("full", 2, {}), ("selective", None, {}), ("full", None, {"cpu_checkpointing": True}),
    ("full", None, {"profile": True}), ("full", 2, {"synchronize_checkpoint_boundary": True}),
    ("selective", None, {"profile": True, "synchronize_checkpoint_boundary": True})])
def test_gradients_bit_for_bit(recompute, layers, options):
    reference = _grads(None)
    other, stats = _run(recompute, layers, **options)
    for name, grad in reference.items():
        assert torch.equal(grad, other[name]), name
    checkpointed = layers or SMALL["num_layers"]  # full: the first N layers; selective: every attention core
    assert stats["forwards"] == stats["recomputes"] == checkpointed


def test_without_recompute_nothing_is_recomputed():
    assert _run(None)[1]["recomputes"] == 0


def test_profile_times_and_prints_every_checkpointed_forward_and_backward(capsys):
    _, stats = _run("full", None, profile=True)
    out = capsys.readouterr().out
    layers = SMALL["num_layers"]
    assert out.count("[megazero] activation checkpoint forward: ") == layers
    assert out.count("[megazero] activation checkpoint recompute and backward: ") == layers
    assert stats["forward_ms"] > 0 and stats["backward_ms"] > 0
    _, quiet = _run("full", None)
    assert quiet["forward_ms"] == quiet["backward_ms"] == 0 and "activation checkpoint" not in capsys.readouterr().out


def _synchronize_ranges(**options) -> tuple[int, dict]:
    """How many synchronize ranges torch's profiler records in one step, and the stats."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _, stats = _run("full", None, **options)
    return sum(1 for e in prof.events() if e.name == ac.SYNCHRONIZE_RANGE), stats


def test_synchronize_checkpoint_boundary_synchronizes_at_every_boundary():
    """Start and end of each checkpointed forward and of each recompute-and-backward: 4 per layer,
    seen in torch's profiler trace (on CPU the device wait itself is a no-op; on CUDA it is
    torch.cuda.synchronize inside the same range)."""
    ranges, stats = _synchronize_ranges(synchronize_checkpoint_boundary=True)
    assert ranges == stats["synchronized_boundaries"] == 4 * SMALL["num_layers"]
    assert _synchronize_ranges()[0] == 0


def test_settings_reflect_configure():
    ac.configure(profile=True, synchronize_checkpoint_boundary=True, cpu_checkpointing=True)
    try:
        assert ac.settings() == {"partition_activations": False, "cpu_checkpointing": True,
                                      "contiguous_memory_optimization": False, "number_checkpoints": None,
                                      "synchronize": True, "profile": True}
    finally:
        ac.configure()
    assert not any(ac.settings().values())


def test_dropout_is_really_on():
    """The bit-equality above is meaningful: other dropout masks give other gradients."""
    reference = _grads(None)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(3)
    model(ids[:, :-1], ids[:, 1:]).backward()
    assert not all(torch.equal(reference[n], p.grad) for n, p in model.named_parameters())




def test_deepspeed_module_name():
    import megazero.checkpointing

    assert megazero.checkpointing.checkpoint is ac.checkpoint
    assert megazero.checkpointing.configure is ac.configure
    # an alias exactly: every public object of the implementation, the same object, and nothing else
    assert megazero.checkpointing.__all__ == ac.__all__
    for name in ac.__all__:
        assert getattr(megazero.checkpointing, name) is getattr(ac, name), name
    public = {name for name, value in vars(ac).items() if not name.startswith("_") and callable(value)
              and getattr(value, "__module__", None) == ac.__name__}
    assert public <= set(ac.__all__), sorted(public - set(ac.__all__))
