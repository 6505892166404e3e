"""Text generation for the causal language models (models/gpt.py, models/llama.py): greedy or
sampled (top-k, nucleus top-p), with a KV cache.

The model it is mixed into is called as `model(ids)` (logits of every position) and as
`model(new_ids, kv_cache=caches)` with one dict per layer (`self.blocks`) that the layers fill
with their keys and values and extend on each later call; its config has seq_length,
vocab_size, sequence_parallel and tensor_model_parallel_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class CausalLMGeneration:
    """generate() for a causal language model (see the module docstring)."""

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
            if use_kv_cache and not self.config.sequence_parallel and input_ids.shape[1] <= self.config.seq_length:
                if cache is None:
                    cache = [{} for _ in self.blocks]
                    logits = self(input_ids, kv_cache=cache)[:, -1]
                else:
                    logits = self(input_ids[:, -1:], kv_cache=cache)[:, -1]
            else:
                logits = self._window_logits(input_ids)
            input_ids = torch.cat([input_ids, self._next_token(logits[:, :vocab_size].float(), temperature, top_k,
                                                               top_p)], dim=1)
        return input_ids

    def _window_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits after the last seq_length tokens, recomputed from scratch."""
        context = input_ids[:, -self.config.seq_length:]
        length = context.shape[1]
        if self.config.sequence_parallel:  # the sequence must split evenly: pad at the end (causal: unseen)
            context = F.pad(context, (0, -length % self.config.tensor_model_parallel_size))
        return self(context)[:, length - 1]

    @staticmethod
    def _next_token(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
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

