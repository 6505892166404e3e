"""Layout-invariant dropout: masks that are a function of the sample, not of the micro-batch.

In the default mode a micro-batch draws its masks from streams keyed by its place in training
(tensor_parallel.random.MicroBatchStreams): one mask for the whole micro-batch, and inside the
tensor-parallel region one per TP rank. That is fast, but a layout that groups the samples into
other micro-batches (another micro-batch size; the single process that must run an EP group's
samples as one micro-batch), or splits the attention heads (TP), draws other masks.

In the layout-invariant mode (the engine config's `dropout_masks.layout_invariant`) every mask
row is drawn from its own generator, seeded by

    (seed, step, the sample's position in the global batch, the layer of the whole model, the
     dropout site[, the global attention head])

so any micro-batch size, DP, TP, SP, PP, v or EP layout draws identical masks for the same sample:
- hidden-state dropout (embedding, attention output, MLP output): one mask per sample over the
  whole sequence and hidden size, the same on every TP rank; under context parallelism a rank
  draws the whole sequence's mask and keeps its chunks' rows, under sequence parallelism its slice;
- attention-probability dropout: one mask per (sample, global head); a TP rank draws its own heads'
  (global head = TP rank x local heads + local head), and the models' attention core computes
  softmax(q k^T / sqrt(d)) with those masks, times v, written out (softmax_attention: torch's
  fused kernel draws its own random numbers, which cannot be keyed this way); context-parallel
  attention takes each block's part of the whole sequence's masks (whole_attention_dropout_mask).
Masks are drawn in fp32 (bernoulli with the keep probability) whatever the compute dtype, so that
fp32 and 16-bit runs drop the same elements; kept elements are scaled by 1 / (1 - p).
The model keys each site by the layer that holds it (a constructor argument, not a running
count), so activation checkpointing recomputes the same masks once the micro-batch's SampleKeys
are restored (megazero.activation_checkpointing does that).

Where the switch lives: the engine config (`dropout_masks.layout_invariant`), not the model's. The
keys are the engine's: the step, and where a micro-batch's rows sit in the global batch, which
only the engine knows (its micro-batch size, the micro-batch's number in the step, the DP rank;
the pipeline schedule's micro-batch). The choice is about how a run is laid out and compared, not
about the model: its parameters, checkpoints, export and generation are the same either way, and
a model used without the engine (evaluation, generation, tests) draws the default mode's masks.
The models ask layout_invariant() at each dropout site (models/common.py: `dropout` and the
attention core) and take the default path when it is False.
"""

from __future__ import annotations

import math

import torch

from megazero.context_parallel.split import load_balanced_positions
from megazero.tensor_parallel.random import SampleKeys, layout_invariant_keys, stream_seed

# dropout sites of a layer (the embedding's is keyed as layer 0's EMBEDDING site)
EMBEDDING, ATTENTION_OUTPUT, MLP_OUTPUT = 0, 1, 2
_HIDDEN_STREAM, _ATTENTION_STREAM = 5, 6  # stream kinds beside random.py's 1-4: their seeds never coincide
_GENERATORS: dict[torch.device, torch.Generator] = {}  # one per device, reseeded for every mask row


def layout_invariant() -> bool:
    """True inside a training micro-batch of the layout-invariant mode."""
    return layout_invariant_keys() is not None


def _generator(device: torch.device) -> torch.Generator:
    if device not in _GENERATORS:
        _GENERATORS[device] = torch.Generator(device=device)
    return _GENERATORS[device]


def _keys_for(x: torch.Tensor) -> SampleKeys:
    keys = layout_invariant_keys()
    if keys is None:
        raise RuntimeError("layout-invariant dropout called outside a layout-invariant training micro-batch")
    if x.shape[0] != keys.rows:
        raise ValueError(f"layout-invariant dropout: the micro-batch has {x.shape[0]} rows, but the engine numbered "
                         f"{keys.rows} samples for it (train_micro_batch_size_per_gpu); pass micro-batches of "
                         f"that size")
    return keys


def _scaled_mask(shape: tuple[int, ...], p: float, device: torch.device, seeds: list[int]) -> torch.Tensor:
    """Rows of bernoulli(1 - p) / (1 - p) over `shape[1:]`, row i drawn from seeds[i]."""
    mask = torch.empty(shape, dtype=torch.float32, device=device)
    flat = mask.view(len(seeds), -1)
    generator = _generator(mask.device)
    for row, seed in enumerate(seeds):
        generator.manual_seed(seed)
        flat[row].bernoulli_(1.0 - p, generator=generator)
    return mask.mul_(1.0 / (1.0 - p)) if p < 1.0 else mask


def hidden_dropout(x: torch.Tensor, p: float, layer: int, site: int, sequence_parallel: bool = False) -> torch.Tensor:
    """Dropout of hidden states [batch, seq (this rank's slice under SP), ...] with per-sample masks
    keyed by (layer, site): the same on every TP rank; under SP this rank's slice of the whole
    sequence's mask."""
    keys = _keys_for(x)
    local = x.shape[1]
    here, start = (local * keys.tp_size, local * keys.tp_rank) if sequence_parallel else (local, 0)
    seeds = [stream_seed(keys.seed, _HIDDEN_STREAM, keys.step, keys.first_sample + row, layer, site)
             for row in range(keys.rows)]
    mask = _scaled_mask((keys.rows, here * keys.cp_size, *x.shape[2:]), p, x.device, seeds)
    if keys.cp_size > 1:  # this CP rank's chunks of the whole sequence
        mask = mask.index_select(1, load_balanced_positions(here * keys.cp_size, keys.cp_size, keys.cp_rank,
                                                            x.device))
    return x * mask[:, start:start + local].to(x.dtype)


def attention_dropout_mask(q: torch.Tensor, seq_k: int, p: float, layer: int) -> torch.Tensor:
    """The dropout masks of the attention probabilities of q's heads over `seq_k` keys, keep
    probability 1 - p, kept elements 1 / (1 - p): [batch, local heads, seq_q, seq_k] fp32, one mask
    per (sample, global head). q: [batch, local heads, seq_q, d] (this TP rank's heads)."""
    keys = _keys_for(q)
    heads, seq_q = q.shape[1], q.shape[2]
    first_head = keys.tp_rank * heads
    seeds = [stream_seed(keys.seed, _ATTENTION_STREAM, keys.step, keys.first_sample + row, layer, first_head + head)
             for row in range(keys.rows) for head in range(heads)]
    return _scaled_mask((keys.rows, heads, seq_q, seq_k), p, q.device, seeds)


def whole_attention_dropout_mask(q: torch.Tensor, seq: int, p: float, layer: int, first_head: int) -> torch.Tensor:
    """attention_dropout_mask's masks over the whole sequence (seq queries and keys, in global order)
    for q.shape[1] heads from global head `first_head` on: what context-parallel attention takes
    its blocks from ([batch, heads, seq, seq] fp32)."""
    keys = _keys_for(q)
    seeds = [stream_seed(keys.seed, _ATTENTION_STREAM, keys.step, keys.first_sample + row, layer, first_head + head)
             for row in range(keys.rows) for head in range(q.shape[1])]
    return _scaled_mask((keys.rows, q.shape[1], seq, seq), p, q.device, seeds)


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                      is_causal: bool = False, dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) [masked]) v written out, the probabilities multiplied by
    `dropout_mask` (attention_dropout_mask's): what torch's fused kernel computes, with masks it
    cannot take. q: [batch, heads, seq_q, d]; k, v may have fewer heads (grouped-query: each serves
    consecutive query heads). attn_mask: bool (True: attend) or additive, broadcastable to
    [batch, heads, seq_q, seq_k]; is_causal: query i sees keys 0..i."""
    heads, seq_q, seq_k = q.shape[1], q.shape[2], k.shape[2]
    if k.shape[1] != heads:
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if is_causal:
        causal = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    if dropout_mask is not None:
        probs = probs * dropout_mask.to(probs.dtype)
    return torch.matmul(probs, v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, layer: int,
              attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """softmax_attention with this mode's dropout on the probabilities (attention_dropout_mask of
    `layer`): the models' attention core (models/common.py) computes the same from the two."""
    return softmax_attention(q, k, v, attn_mask, is_causal, attention_dropout_mask(q, k.shape[2], p, layer))


__all__ = ["ATTENTION_OUTPUT", "EMBEDDING", "MLP_OUTPUT", "attention", "attention_dropout_mask", "hidden_dropout",
           "layout_invariant", "softmax_attention", "whole_attention_dropout_mask"]
