"""A stage's model chunks under the interleaved schedule: one module over v pipeline stages.

Chunk c of pipeline stage s is virtual stage c * p + s of the model split into p * v stages
(megazero.pipeline.interleaved). ModelChunks holds them as `chunks.0`, `chunks.1`, ... and
answers the model contract (megazero.model_contract) for all of them: every parameter under its
name in the whole model (`chunks.1.blocks.0.x` of the chunk holding layer 6 is `blocks.6.x`), so
checkpoints stay layout-free; the tied word embedding of whichever chunk holds it.

Calling it runs one chunk: the engine passes the chunk under MODEL_CHUNK with the micro-batch's
keyword arguments (model_chunks() is how the engine asks how many there are).
"""

from __future__ import annotations

import torch.nn as nn

from megazero.model_contract import global_name_of, tied_parameters, total_parameters

MODEL_CHUNK = "model_chunk"  # the keyword naming the chunk a ModelChunks call runs


class ModelChunks(nn.Module):
    """v model chunks of one pipeline stage (virtual stages s, p + s, 2p + s, ...)."""

    def __init__(self, chunks: list[nn.Module]):
        super().__init__()
        if len(chunks) < 2:
            raise ValueError(f"ModelChunks holds 2 or more model chunks, got {len(chunks)}")
        self.chunks = nn.ModuleList(chunks)
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
        """The chunks' tied parameters (the word embedding on the first and the last virtual stage)."""
        return [p for chunk in self.chunks for p in tied_parameters(chunk)]

    def total_parameters(self) -> int:
        """Parameters of the whole model (each chunk knows the whole model's count)."""
        return total_parameters(self.chunks[0])


def model_chunks(module: nn.Module) -> list[nn.Module]:
    """The model chunks of a stage: a ModelChunks' chunks, else the module alone."""
    return list(module.chunks) if isinstance(module, ModelChunks) else [module]


def chunk_stage(chunk: int, stage: int, num_stages: int) -> int:
    """The virtual stage of model chunk `chunk` on pipeline stage `stage`: chunk * p + stage."""
    return chunk * num_stages + stage


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


__all__ = ["MODEL_CHUNK", "ModelChunks", "chunk_count", "chunk_stage", "model_chunks"]
