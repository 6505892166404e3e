"""How ZeRO stages 1-2 bring every rank the updated parameters after the step: DeepSpeed's
`zero_optimization.allgather_partitions` and `allgather_bucket_size`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParameterGathering:
    """`broadcasts`: each rank broadcasts its partition (allgather_partitions false) instead of one
    all-gather per bucket; `bucket_numel`: the most elements one gather moves (allgather_bucket_size;
    None: a whole reduce bucket)."""

    broadcasts: bool = False
    bucket_numel: int | None = None

    @classmethod
    def of(cls, zero_config) -> ParameterGathering:
        """The gathering a ZeroConfig asks for."""
        return cls(not zero_config.allgather_partitions, zero_config.allgather_bucket_size)


DEFAULT_GATHERING = ParameterGathering()  # one all-gather per reduce bucket
