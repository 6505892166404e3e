"""A stage's model chunks: one module over v parts (virtual stages) of the model.

Which virtual stage chunk c of pipeline stage s is, is the chunks' layout: LOOP (the interleaved
schedule, megazero.pipeline.interleaved) puts it at c * p + s of the model split into p * v
stages, so an activation goes round the ring of stages v times; V (the zbv schedule, two chunks)
puts chunk 0 at s and chunk 1 at 2p - 1 - s, so rank 0 holds the first and the last part and the
activation goes down the stages and back up. ModelChunks holds them as `chunks.0`, `chunks.1`, ... and
answers the model contract (megazero.model_contract) for all of them: every parameter under its
name in the whole model (`chunks.1.blocks.0.x` of the chunk holding layer 6 is `blocks.6.x`), so
checkpoints stay layout-free; the tied word embedding of whichever chunk holds it (none to sum
across stages when one rank holds both the first and the last part: its two chunks then share the
one parameter, models.parallelize.build_chunks).

Calling it runs one chunk: the engine passes the chunk under MODEL_CHUNK with the micro-batch's
keyword arguments (model_chunks() is how the engine asks how many there are).
"""

from __future__ import annotations

import torch.nn as nn

from megazero.model_contract import global_name_of, tied_parameters, total_parameters

MODEL_CHUNK = "model_chunk"  # the keyword naming the chunk a ModelChunks call runs
LOOP, V = "loop", "v"  # the chunk layouts


def chunk_stage(chunk: int, stage: int, num_stages: int, layout: str = LOOP) -> int:
    """The virtual stage of model chunk `chunk` on pipeline stage `stage` of `num_stages`: LOOP
    chunk * p + stage; V stage for chunk 0, 2p - 1 - stage for chunk 1."""
    if layout == V:
        return stage if chunk == 0 else 2 * num_stages - 1 - stage
    return chunk * num_stages + stage


def chunk_place(virtual: int, num_stages: int, layout: str = LOOP) -> tuple[int, int]:
    """(pipeline stage, chunk) holding virtual stage `virtual` (chunk_stage's inverse)."""
    if layout == V:
        return (virtual, 0) if virtual < num_stages else (2 * num_stages - 1 - virtual, 1)
    return virtual % num_stages, virtual // num_stages


class ModelChunks(nn.Module):
    """v model chunks of one pipeline stage, at the virtual stages `layout` gives them (LOOP: s, p + s,
    2p + s, ...; V: s and 2p - 1 - s)."""

    def __init__(self, chunks: list[nn.Module], layout: str = LOOP):
        super().__init__()
        if len(chunks) < 2:
            raise ValueError(f"ModelChunks holds 2 or more model chunks, got {len(chunks)}")
        if layout not in (LOOP, V) or (layout == V and len(chunks) != 2):
            raise ValueError(f"ModelChunks layout {layout!r} with {len(chunks)} chunks: expected {LOOP!r}, or {V!r} "
                             f"with 2 chunks")
        self.chunks = nn.ModuleList(chunks)
        self.layout = layout
        self.config = getattr(chunks[0], "config", None)  # the model's config, for checkpoints

    def forward(self, *args, model_chunk: int, **kwargs):
        """Run chunk `model_chunk` on the arguments."""
        return self.chunks[model_chunk](*args, **kwargs)

    def global_parameter_name(self, name: str) -> str:
        """`chunks.c.<name>` as chunk c names `<name>` in the whole model."""
        if not name.startswith("chunks."):
            raise ValueError(f"ModelChunks has no parameter or buffer {name!r} outside its chunks")
        index, rest = name[len("chunks."):].split(".", 1)
        return global_name_of(self.chunks[int(index)])(rest)

    def tied_parameters(self) -> list[nn.Parameter]:
        """The chunks' tied parameters (the word embedding on the first and the last virtual stage),
        but for one two chunks share (both ends here: nothing to sum across stages)."""
        found = [p for chunk in self.chunks for p in tied_parameters(chunk)]
        return [p for p in found if sum(q is p for q in found) == 1]

    def total_parameters(self) -> int:
        """Parameters of the whole model (each chunk knows the whole model's count)."""
        return total_parameters(self.chunks[0])


def model_chunks(module: nn.Module) -> list[nn.Module]:
    """The model chunks of a stage: a ModelChunks' chunks, else the module alone."""
    return list(module.chunks) if isinstance(module, ModelChunks) else [module]


def chunk_layout(module: nn.Module) -> str:
    """The layout of a stage's model chunks (LOOP for a single chunk)."""
    return module.layout if isinstance(module, ModelChunks) else LOOP


def chunk_count(num_layers: int, num_stages: int, layers_per_virtual_stage: int | None) -> int:
    """Model chunks per stage for Megatron's --num-layers-per-virtual-pipeline-stage (None: 1)."""
    if layers_per_virtual_stage is None:
        return 1
    if num_stages < 2:
        raise ValueError("num_layers_per_virtual_pipeline_stage needs pipeline parallelism "
                         f"(pipeline_model_parallel_size >= 2, got {num_stages})")
    if layers_per_virtual_stage < 1 or num_layers % (num_stages * layers_per_virtual_stage):
        raise ValueError(f"num_layers {num_layers} is not divisible by pipeline_model_parallel_size {num_stages} "
                         f"x num_layers_per_virtual_pipeline_stage {layers_per_virtual_stage}")
    return num_layers // (num_stages * layers_per_virtual_stage)


__all__ = ["LOOP", "MODEL_CHUNK", "V", "ModelChunks", "chunk_count", "chunk_layout", "chunk_place", "chunk_stage",
           "model_chunks"]
