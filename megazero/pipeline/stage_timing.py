"""The measured stage split's weights (pipeline.partition_method "measured"): the forward + backward
time of one layer of each kind, of the first stage's extra work (embeddings) and of the last
stage's (final norm, output layer and loss), timed at build time on a micro-batch of the run's
shape on the run's device, so that the split follows what this machine spends, not what the
FLOP count predicts (on a CPU the output layer's one large matmul runs faster per FLOP than the
layers' small ones: GPT at hidden 192 measured 2.1-2.3 layers of time for 3.2 of FLOPs).

Every rank of the world times the same pieces at once (so under the same load as training, and
tensor/expert-parallel peers run their collectives together), the times are averaged over the
world and the integer weights broadcast from rank 0, so every rank computes the same split. The
random number generators (the default ones and the tensor-parallel tracker) are restored after,
so a model built after the measurement starts as without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from megazero.tensor_parallel.random import get_rng_tracker

# the weights are in 1/UNITS of the cheapest layer's time: whole numbers, so the split's exact DP
# and its ties are the same on every rank, and timing noise below 1% of a layer changes nothing
UNITS = 100


def _run(piece: nn.Module, batch: dict, hidden: torch.Tensor | None, grad: torch.Tensor | None) -> torch.Tensor:
    """One forward and backward of `piece` (with `hidden` as its input hidden states, if given);
    returns the output (hidden states, or the loss) detached."""
    kwargs = dict(batch) if hidden is None else {**batch, "hidden_states": hidden.detach().requires_grad_()}
    out = piece(**kwargs)
    out.backward(grad if grad is not None and out.dim() else None)
    piece.zero_grad(set_to_none=True)
    return out.detach()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_stage_weights(build: Callable[[range, bool, bool], nn.Module], batch: dict, layer_kinds: list,
                          repeats: int = 9, warmup: int = 3) -> tuple[list[int], int, int]:
    """(a weight per layer, the first stage's extra, the last stage's extra) in 1/UNITS of the
    cheapest layer's forward + backward time. build(layers, pre_process, post_process) makes a
    pipeline stage holding `layers` (with the embeddings, with the head and loss); batch: one
    micro-batch's keyword arguments (ids and labels); layer_kinds: one hashable per layer, equal
    for layers that cost the same (one layer of each kind is timed)."""
    num_layers = len(layer_kinds)
    if num_layers < 2:
        raise ValueError(f"the measured stage split needs 2 or more layers, got {num_layers}")
    tracker_states = get_rng_tracker().get_states()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        first = build(range(0, 1), True, False).train()
        last = build(range(num_layers - 1, num_layers), False, True).train()
        kinds = {}  # kind -> its first layer's one-layer middle piece
        for i, kind in enumerate(layer_kinds):
            kinds.setdefault(kind, i)
        middles = {kind: build(range(i, i + 1), False, False).train() for kind, i in kinds.items()}
        device = next(first.parameters()).device
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.no_grad():
            hidden = first(**batch)  # the shape every later piece takes and returns
        grad = torch.randn_like(hidden)
        pieces = {"first": (first, None), "last": (last, hidden), **{("layer", k): (m, hidden)
                                                                     for k, m in middles.items()}}
        times = {name: [] for name in pieces}
        for round_ in range(warmup + repeats):
            for name, (piece, given) in pieces.items():  # alternating: load changes hit every piece alike
                _synchronize(device)
                start = time.perf_counter()
                _run(piece, batch, given, grad)
                _synchronize(device)
                if round_ >= warmup:
                    times[name].append(time.perf_counter() - start)
    get_rng_tracker().set_states(tracker_states)
    # the fastest of the repeats: load on a shared machine only ever adds time, and a spike in one
    # piece's median (seen at 5 repeats) moved the split by a layer
    fastest = torch.tensor([min(times[name]) for name in pieces], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(fastest)
        fastest /= dist.get_world_size()
    seconds = dict(zip(pieces, fastest.tolist()))
    layer = {kind: seconds[("layer", kind)] for kind in kinds}
    unit = min(layer.values()) / UNITS
    weights = torch.tensor([round(layer[kind] / unit) for kind in layer_kinds]
                           + [max(0, round((seconds["first"] - layer[layer_kinds[0]]) / unit)),
                              max(0, round((seconds["last"] - layer[layer_kinds[-1]]) / unit))], dtype=torch.int64)
    if dist.is_initialized():
        dist.broadcast(weights, src=0)  # one split everywhere, whatever the float sums did
    values = weights.tolist()
    return values[:num_layers], values[num_layers], values[num_layers + 1]


__all__ = ["UNITS", "measure_stage_weights"]
