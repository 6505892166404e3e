"""Megatron-style tensor parallelism: layers, communication mappings, cross entropy, RNG tracker."""

from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megazero.tensor_parallel.layers import (
    ColumnParallelLinear,
    LayerNorm,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megazero.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
    sync_replicated_grad,
)
from megazero.tensor_parallel.random import get_rng_tracker, model_parallel_seed
from megazero.tensor_parallel.utils import is_tensor_parallel, merge_shards, shard_of

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "LayerNorm", "RMSNorm",
           "ReplicatedLinear",
           "vocab_parallel_cross_entropy", "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
           "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
           "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region", "sync_replicated_grad", "get_rng_tracker",
           "model_parallel_seed", "is_tensor_parallel", "merge_shards", "shard_of"]
