"""Sampling from a pipelined causal language model (GPT, Llama): each stage runs its own layers
with its own per-layer KV cache, and the new tokens' activations go stage to stage.

Every rank of a pipeline calls `pipelined_generate` with the same prompt (its tensor-parallel peers
too, which run their shards alongside, as in one process). Each step feeds what the model's
step_input says (the prompt, then only the newest token through the caches; past seq_length the
whole window again, without them); the activations go from virtual stage to virtual stage with
StageLinks (around the ring of stages v times when the stage holds v model chunks in the loop
layout, down the stages and back up in the V layout, megazero.pipeline.ModelChunks); the stage
holding the last virtual stage takes the logits of the position, picks the token
with the model's next_token (both from models/generation.py's CausalLMGeneration, which the models
mix in) and broadcasts it over the pipeline group, so every stage appends the same token and all
of them stop after the same max_new_tokens.

The layers compute exactly what they do in one process, so greedy output equals the single
process's token for token, and sampled output too when that stage's default generator is
seeded as the single process's is (it is the only one that draws).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.pipeline.chunks import LOOP, chunk_layout, chunk_place, chunk_stage, model_chunks
from megazero.pipeline.p2p import StageLinks


def _floating_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype the stage computes (and sends) activations in: its floating-point parameters'."""
    return next(p.dtype for p in module.parameters() if p.is_floating_point())


@torch.no_grad()
def pipelined_generate(module: torch.nn.Module, grid, input_ids: torch.Tensor, max_new_tokens: int,
                       temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                       vocab_size: int | None = None, use_kv_cache: bool = True) -> torch.Tensor:
    """Continue `input_ids` ([batch, length], the same on every rank of the pipeline) by
    max_new_tokens tokens, as models.generation.CausalLMGeneration.generate does in one process
    (greedy when temperature == 0; vocab_size: sample only the first vocab_size ids). `module` is
    this rank's stage of `grid`'s pipeline (models.parallelize.parallelize's module: one stage or
    its ModelChunks), in eval mode. Returns the whole text on every rank."""
    if grid is None or grid.pipeline_model_parallel_size == 1:
        return module.generate(input_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               vocab_size=vocab_size, use_kv_cache=use_kv_cache)
    config = module.config
    vocab_size = vocab_size or config.vocab_size
    chunks = model_chunks(module)
    layout = chunk_layout(module)
    plan = type(chunks[0])  # step_input and next_token: the model's own (CausalLMGeneration's)
    stage, stages = grid.pp_rank, grid.pipeline_model_parallel_size
    last_virtual = stages * len(chunks) - 1
    device = next(module.parameters()).device
    links = StageLinks(grid.pp_ranks, stage, grid.pp_group, _floating_dtype(module), device,
                       ring=len(chunks) > 1 and layout == LOOP)
    input_ids = input_ids.to(device)
    caches = None
    for _ in range(max_new_tokens):
        step = plan.step_input(input_ids, config, use_kv_cache, caches is not None)
        if step.cached and caches is None:
            caches = [[{} for _ in chunk.blocks] for chunk in chunks]
        token, handed = None, None
        # this stage's chunks in model order; the activation comes from the stage holding the part
        # before (this one at the turn of a V) and goes to the one holding the part after
        for c, chunk in enumerate(chunks):
            virtual = chunk_stage(c, stage, stages, layout)
            source, destination = (chunk_place(v, stages, layout)[0] for v in (virtual - 1, virtual + 1))
            if virtual == 0:
                kwargs = {"input_ids": step.ids}
            elif source == stage:
                kwargs = {"hidden_states": handed}
            else:
                kwargs = {"hidden_states": links.transfer([], [(grid.pp_ranks[source], True)])[0].wait()}
            if step.cached:
                kwargs["kv_cache"] = caches[c]
            out = chunk(**kwargs)
            if virtual == last_virtual:
                token = plan.next_token(out[:, step.position, :vocab_size].float(), temperature, top_k, top_p)
            elif destination == stage:
                handed = out
            else:
                links.transfer([(out, grid.pp_ranks[destination], True)], [])
        if token is None:
            token = torch.empty(input_ids.shape[0], 1, dtype=torch.long, device=device)
        dist.broadcast(token, src=grid.pp_ranks[chunk_place(last_virtual, stages, layout)[0]], group=grid.pp_group)
        input_ids = torch.cat([input_ids, token], dim=1)
    links.flush()  # the sends (which return once posted) all complete
    return input_ids


__all__ = ["pipelined_generate"]
