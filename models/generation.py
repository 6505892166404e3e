"""Text generation for the causal language models (models/gpt.py, models/llama.py): greedy or
sampled (top-k, nucleus top-p), with a KV cache.

The model it is mixed into is called as `model(ids)` (logits of every position) and as
`model(new_ids, kv_cache=caches)` with one dict per layer (`self.blocks`) that the layers fill
with their keys and values and extend on each later call; its config has seq_length,
vocab_size, sequence_parallel and tensor_model_parallel_size.

What each step feeds (`step_input`) and how the token is picked (`next_token`) are functions of
their own (and methods of the models) so that a pipelined model (megazero.pipeline.generation)
decodes exactly as one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class StepInput:
    """One decoding step: the ids to feed, whether through the KV cache, and the position whose
    logits pick the next token."""

    ids: torch.Tensor
    cached: bool
    position: int


def step_input(input_ids: torch.Tensor, config, use_kv_cache: bool, cache_started: bool) -> StepInput:
    """What the next step feeds, given the text so far: with the KV cache, the whole prompt on the
    first step and then only the newest token; once the text outgrows seq_length (or under
    sequence parallelism, whose split sequence the cache does not serve), the last seq_length
    tokens recomputed from scratch (padded at the end to a multiple of TP under SP: causal, so
    unseen)."""
    if use_kv_cache and not config.sequence_parallel and input_ids.shape[1] <= config.seq_length:
        return StepInput(input_ids[:, -1:] if cache_started else input_ids, True, -1)
    context = input_ids[:, -config.seq_length:]
    length = context.shape[1]
    if config.sequence_parallel:  # the sequence must split evenly
        context = F.pad(context, (0, -length % config.tensor_model_parallel_size))
    return StepInput(context, False, length - 1)


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """The next token of each row ([batch, 1]) from fp32 logits [batch, vocab]: the argmax when
    temperature == 0, else a draw from the default generator after temperature, top-k and top-p."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = F.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - F.softmax(sorted_logits, dim=-1) >= top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


class CausalLMGeneration:
    """generate() for a causal language model (see the module docstring)."""

    # the step plan and the token picker as the models' own methods: megazero.pipeline.generation
    # decodes a pipelined model through them (the library does not import models/)
    step_input = staticmethod(step_input)
    next_token = staticmethod(next_token)
    _next_token = next_token

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, vocab_size: int | None = None,
                 use_kv_cache: bool = True) -> torch.Tensor:
        """Continue `input_ids` by max_new_tokens tokens: greedy when temperature == 0, else sampled
        (top-k and/or nucleus top-p) from the model's vocab_size tokens (the logits hold no padding),
        or from the first `vocab_size` ids when given (a tokenizer's). With the KV cache each step
        feeds only the new token; once the text outgrows seq_length, the window slides and the whole
        window is recomputed, exactly as without the cache."""
        vocab_size = vocab_size or self.config.vocab_size
        cache = None
        for _ in range(max_new_tokens):
            step = step_input(input_ids, self.config, use_kv_cache, cache is not None)
            if step.cached and cache is None:
                cache = [{} for _ in self.blocks]
            logits = (self(step.ids, kv_cache=cache) if step.cached else self(step.ids))[:, step.position]
            input_ids = torch.cat([input_ids, next_token(logits[:, :vocab_size].float(), temperature, top_k, top_p)],
                                  dim=1)
        return input_ids
