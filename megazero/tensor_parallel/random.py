"""RNG states for tensor parallelism (Megatron's tracker).

Dropout applied to activations every TP rank holds whole must draw the same mask on every TP
rank; dropout inside the tensor-parallel region (attention probabilities of this rank's heads)
must draw different masks per TP rank. The default generator (seeded identically on all ranks)
serves the first; the tracker holds a named extra state, seeded per TP rank, and `fork(name)`
runs a block with it swapped in. Activation checkpointing saves and restores the tracker's
states with the default ones, so recomputed dropout masks equal the original ones.

Training forwards draw from keyed streams (MicroBatchStreams): before each micro-batch the engine
seeds the default generator and the tracker from (seed, step, micro-batch index in the global
batch, pipeline stage[, TP rank]) and puts the process's own states back afterwards. Dropout masks
are then a function of where a micro-batch is in training, not of what consumed random numbers
before it (an evaluation, a sample, a throughput probe, a restart), so a resumed run draws the
masks of an uninterrupted one at any layout that keeps those coordinates.

The opt-in layout-invariant mode (the engine config's `dropout_masks.layout_invariant`) keys every
mask by the samples instead: micro_batch() then also publishes SampleKeys (seed, step, the global
batch positions of the micro-batch's rows, TP rank), and the models' dropout sites draw per-sample
(and per-attention-head) masks from them (megazero.tensor_parallel.invariant_dropout), so that any
micro-batch size, DP, TP, SP, PP, v or EP layout draws the same masks for the same sample.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718  # Megatron's offset: the TP seeds differ from the data seed
_MASK64 = (1 << 64) - 1
_DEFAULT_STREAM, _TENSOR_PARALLEL_STREAM = 1, 2  # stream kinds: their seeds never coincide
_LAYER_STREAM, _LAYER_TENSOR_PARALLEL_STREAM = 3, 4
_ACTIVE: list[tuple[MicroBatchStreams, int, int]] = []  # the training micro-batch running: (streams, step, index)


@dataclass(frozen=True)
class SampleKeys:
    """What a layout-invariant dropout mask depends on besides its layer and site: the seed, the step,
    the positions in the global batch of the micro-batch's rows (first_sample, first_sample + 1, ...;
    `rows` of them), the TP rank and size (which attention heads, which slice of the sequence under
    SP, this rank holds) and the CP rank and size (which chunks of the sequence)."""

    seed: int
    step: int
    first_sample: int
    rows: int
    tp_rank: int = 0
    tp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1


_KEYED: list[SampleKeys | None] = []  # the layout-invariant micro-batch running (None: the default mode)


def layout_invariant_keys() -> SampleKeys | None:
    """The running training micro-batch's SampleKeys in the layout-invariant mode, else None (the
    default mode, evaluation, generation, a model used without the engine)."""
    return _KEYED[-1] if _KEYED else None


@contextlib.contextmanager
def sample_keys_restored(keys: SampleKeys | None):
    """Run the block with `keys` as the running micro-batch's (activation checkpointing's recompute,
    in backward, outside the forward's micro_batch(): it redraws the forward's masks)."""
    _KEYED.append(keys)
    try:
        yield
    finally:
        _KEYED.pop()


def _device_of_default() -> str:
    return "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"


def _forked_kinds() -> tuple[str, ...]:
    """The generators a forward can draw from now: the CPU's, and the current GPU's once CUDA is
    initialised (a forward on the GPU has initialised it)."""
    return ("cpu", "cuda") if _device_of_default() == "cuda" else ("cpu",)


def _generator(kind: str) -> torch.Generator:
    return torch.default_generator if kind == "cpu" else torch.cuda.default_generators[torch.cuda.current_device()]


def _seeded_state(kind: str, seed: int) -> torch.Tensor:
    """The state of `kind`'s generator right after manual_seed(seed) (made on the side)."""
    return torch.Generator(device=kind).manual_seed(seed).get_state()


class RNGStatesTracker:
    """Named RNG states, each swapped into the default generators inside fork(name).

    A state is its seed plus one generator state per device kind ("cpu", "cuda": the current GPU),
    each made from the seed the first time a fork draws on that kind. So the tracker does not
    depend on whether CUDA was initialised when add() ran: seeded before the model moved to the
    GPU, fork() still swaps the GPU's generator, and the GPU's dropout draws from the per-TP-rank
    stream (as if the state had been seeded on the GPU at add()).
    """

    _SEP = "/"  # get_states() keys: "<name>/seed", "<name>/cpu", "<name>/cuda"

    def __init__(self):
        self.seeds: dict[str, int] = {}
        self.states: dict[str, dict[str, torch.Tensor]] = {}  # name -> {device kind: generator state}

    def reset(self) -> None:
        """Forget every state."""
        self.seeds, self.states = {}, {}

    def add(self, name: str, seed: int) -> None:
        """A new state `name` seeded with `seed` (the default generators are left as they were)."""
        if self._SEP in name:
            raise ValueError(f"RNG tracker state names may not contain {self._SEP!r}, got {name!r}")
        self.seeds[name] = int(seed)
        self.states[name] = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of all states as tensors (for checkpoints and recomputation)."""
        out = {}
        for name, seed in self.seeds.items():
            out[f"{name}{self._SEP}seed"] = torch.tensor(seed, dtype=torch.int64)
            for kind, state in self.states[name].items():
                out[f"{name}{self._SEP}{kind}"] = state.clone()
        return out

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore states taken by get_states() (or, from older checkpoints, {name: CPU state})."""
        self.reset()
        for key, value in states.items():
            name, _, field = key.rpartition(self._SEP)
            if not name:  # the older format: a name's CPU generator state, which holds its seed
                name, field = key, "cpu"
                self.seeds.setdefault(name, torch.Generator().set_state(value).initial_seed())
            if field == "seed":
                self.seeds[name] = int(value)
            else:
                self.states.setdefault(name, {})[field] = value.clone()
            self.states.setdefault(name, {})

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block drawing random numbers from state `name`, on the CPU and on the current GPU
        (once CUDA is initialised); a no-op if the state was never added."""
        if name not in self.seeds:
            yield
            return
        kinds, states = _forked_kinds(), self.states[name]
        for kind in kinds:
            if kind not in states:
                states[kind] = _seeded_state(kind, self.seeds[name])
        saved = {kind: _generator(kind).get_state() for kind in kinds}
        for kind in kinds:
            _generator(kind).set_state(states[kind])
        try:
            yield
        finally:
            for kind in kinds:
                states[kind] = _generator(kind).get_state()
                _generator(kind).set_state(saved[kind])


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


def _mix64(value: int) -> int:
    """splitmix64's finaliser: nearby inputs give unrelated 64-bit outputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def stream_seed(seed: int, *coordinates: int) -> int:
    """A 63-bit generator seed that depends on `seed` and every coordinate, in order (the same on
    every machine and torch version)."""
    value = _mix64(seed & _MASK64)
    for coordinate in coordinates:
        if coordinate < 0:
            raise ValueError(f"stream coordinates must be >= 0, got {coordinates}")
        value = _mix64(value ^ coordinate)
    return value >> 1


class MicroBatchStreams:
    """The random streams a training forward draws from, keyed by where the micro-batch is.

    Micro-batch `index` of a global batch is numbered micro_index * dp_size + dp_rank, which is
    the order DistributedBatchLoader hands out samples in, so a micro-batch of the same samples
    gets the same number at every data-parallel size (and gradient accumulation that keeps the
    micro-batch size). The default generator's stream (dropout on activations every TP rank holds
    whole) is the same on all TP ranks; the tracker's (inside the tensor-parallel region, and
    sequence-parallel activations) differs per TP rank; both differ per pipeline stage, which
    holds other layers.

    layout_invariant: micro_batch() also publishes SampleKeys for the micro-batch's samples
    (layout_invariant_keys), from which the models draw per-sample masks instead.
    """

    def __init__(self, seed: int, pp_rank: int = 0, tp_rank: int = 0, tp_size: int = 1,
                 layout_invariant: bool = False, cp_rank: int = 0, cp_size: int = 1):
        self.seed = int(seed)
        self.pp_rank, self.tp_rank, self.tp_size = pp_rank, tp_rank, tp_size
        self.cp_rank, self.cp_size = cp_rank, cp_size
        # the default mode's streams differ per CP rank (which holds other tokens of the same samples)
        self._cp_key = (cp_rank,) if cp_size > 1 else ()
        self.layout_invariant = layout_invariant

    def layer_seeds(self, step: int, index: int, layer: int) -> tuple[int, int]:
        """(default generator seed, tracker seed) of layer `layer` (its number in the whole model)
        in micro-batch `index` of step `step`: no pipeline stage in them, so every layout agrees."""
        return (stream_seed(self.seed, _LAYER_STREAM, step, index, layer, *self._cp_key),
                stream_seed(self.seed, _LAYER_TENSOR_PARALLEL_STREAM, step, index, layer, self.tp_rank, *self._cp_key))

    def seeds(self, step: int, index: int) -> tuple[int, int]:
        """(default generator seed, tracker seed) of micro-batch `index` of step `step` (0-based)."""
        return (stream_seed(self.seed, _DEFAULT_STREAM, step, index, self.pp_rank, *self._cp_key),
                stream_seed(self.seed, _TENSOR_PARALLEL_STREAM, step, index, self.pp_rank, self.tp_rank, *self._cp_key))

    @contextlib.contextmanager
    def micro_batch(self, step: int, index: int, samples: range | None = None):
        """Run a training forward on this micro-batch's streams; the process's generators (CPU, the
        current CUDA device) and the tracker's states are as before afterwards. samples: the
        positions in the global batch of its rows (needed in the layout-invariant mode)."""
        if self.layout_invariant:
            if samples is None or samples.step != 1:
                raise ValueError(f"layout-invariant dropout needs the micro-batch's samples as a range of "
                                 f"consecutive positions in the global batch, got {samples!r}")
            keys = SampleKeys(self.seed, step, samples.start, len(samples), self.tp_rank, self.tp_size, self.cp_rank,
                              self.cp_size)
            with sample_keys_restored(keys), self._streams(step, index):
                yield
            return
        with self._streams(step, index):
            yield

    @contextlib.contextmanager
    def _streams(self, step: int, index: int):
        default_seed, tracker_seed = self.seeds(step, index)
        device = _device_of_default()
        saved_tracker = _TRACKER.get_states()
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []):
            _TRACKER.reset()  # without TP, fork() must be a no-op, whatever an earlier engine left there
            if self.tp_size > 1:
                _TRACKER.add(MODEL_PARALLEL_RNG, tracker_seed)
            torch.default_generator.manual_seed(default_seed)
            if device == "cuda":
                torch.cuda.manual_seed(default_seed)  # the current device only, which fork_rng restores
            _ACTIVE.append((self, step, index))
            try:
                yield
            finally:
                _ACTIVE.pop()
                _TRACKER.set_states(saved_tracker)


def layer_stream(layer: int):
    """Inside a training micro-batch (MicroBatchStreams.micro_batch), seed the generators for
    layer `layer` of the whole model from (seed, step, micro-batch, layer[, TP rank]): a layer's
    dropout masks are then the same whichever pipeline stage, or model chunk, runs it. Outside one
    (evaluation, generation, a model used without the engine) nothing changes. Seeds, and
    returns nothing to undo: micro_batch() restores the process's generators at its end."""
    if not _ACTIVE:
        return
    streams, step, index = _ACTIVE[-1]
    default_seed, tracker_seed = streams.layer_seeds(step, index, layer)
    torch.default_generator.manual_seed(default_seed)
    if _device_of_default() == "cuda":
        torch.cuda.manual_seed(default_seed)
    if streams.tp_size > 1:
        _TRACKER.reset()
        _TRACKER.add(MODEL_PARALLEL_RNG, tracker_seed)
