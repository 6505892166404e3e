"""The tensor x pipeline x data-parallel grid of process groups (Megatron's rank order).

Ranks are laid out with tensor parallelism innermost, then data parallelism, then pipeline
stages outermost, so the ranks of one TP group are consecutive (on one node, where bandwidth is
highest) and a pipeline stage is a contiguous block of tp * dp ranks:

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

Expert parallelism (EP) splits the data-parallel dimension, as Megatron core's expert rank
generator does (order "tp-ep-dp-pp"): dp_rank = expert_dp_rank * ep + ep_rank. The expert-model-
parallel group is `ep` consecutive members of a data-parallel group (same TP rank and stage),
which hold different experts; the expert-data-parallel group is the data-parallel members with
the same EP index, which hold the same experts and average their gradients. E.g. TP=2, DP=4, EP=2
(8 ranks): EP groups [0,2] [1,3] [4,6] [5,7], expert-DP groups [0,4] [1,5] [2,6] [3,7].

Context parallelism (CP) also splits the data-parallel dimension, innermost, as Megatron core's
order "tp-cp-dp-pp" places it: dp_rank = sample_shard * cp + cp_rank. The `cp` consecutive members
of a data-parallel group read the same samples and split each sample's sequence; the data-parallel
group (DP x CP) is the one gradients are averaged over and ZeRO partitions over, while the batch is
split `sample_shards` = DP / CP ways (the loader, the batch size). E.g. TP=2, CP=2, DP=2 (8 ranks):
CP groups [0,2] [1,3] [4,6] [5,7], data-parallel groups (with CP) [0,2,4,6] [1,3,5,7]. With both,
EP splits the data-parallel dimension (DP x CP) as above, so an EP group is a CP group, holds whole
CP groups, or lies inside one (one size must divide the other): the experts see tokens of whole
sequences or of parts of them alike.

`initialize_model_parallel(tp, pp)` builds the grid once per process and makes this module the
`mpu` that `megazero.initialize(..., mpu=parallel_state)` accepts (DeepSpeed's convention); the
library itself receives the groups explicitly, as a `ParallelGrid`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class ParallelGrid:
    """This rank's coordinates in the grid and the process groups it belongs to."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: object
    pp_group: object
    dp_group: object
    model_parallel_group: object  # tp x pp: every rank holding a piece of one model replica
    embedding_group: object | None  # first and last pipeline stage (tied word embeddings)
    pp_ranks: list[int]  # global ranks of this rank's pipeline, by stage
    expert_model_parallel_size: int = 1
    ep_rank: int = 0  # index in the expert-model-parallel group: holds experts [ep_rank * E/EP, ...)
    expert_dp_rank: int = 0  # index in the expert-data-parallel group
    ep_group: object | None = None  # this rank's EP peers (None at EP = 1: no group is built)
    expert_dp_group: object | None = None  # peers holding the same experts (the dp group at EP = 1)
    context_parallel_size: int = 1
    cp_rank: int = 0  # index in the context-parallel group: holds chunks cp_rank and 2 CP - 1 - cp_rank
    cp_group: object | None = None  # this rank's CP peers (None at CP = 1)

    @property
    def sample_shards(self) -> int:
        """How many ways each global batch is split between ranks: DP / CP (CP ranks share samples)."""
        return self.data_parallel_size // self.context_parallel_size

    @property
    def sample_shard(self) -> int:
        """Which of the sample_shards this rank reads."""
        return self.dp_rank // self.context_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Data-parallel replicas of each expert: DP / EP."""
        return self.data_parallel_size // self.expert_model_parallel_size

    @property
    def is_first_stage(self) -> bool:
        """True on the pipeline stage that holds the embeddings."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the pipeline stage that holds the head and the loss."""
        return self.pp_rank == self.pipeline_model_parallel_size - 1


def grid_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    """Global rank of grid coordinates (TP innermost, then DP, then PP)."""
    return pp_rank * dp * tp + dp_rank * tp + tp_rank


def grid_groups(world: int, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                expert_model_parallel_size: int = 1,
                context_parallel_size: int = 1) -> dict[str, list[tuple[int, ...]]]:
    """Every group of the grid as sorted global-rank tuples, by kind ("tp", "dp", "pp", "mp", and
    "embedding" with pipelining, "ep" and "expert_dp" with expert parallelism, "cp" with context
    parallelism), in the order build_grid() creates them. Pure rank arithmetic: no process group
    is touched. ValueError names the sizes that do not divide."""
    tp, pp, ep, cp = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size, \
        context_parallel_size
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tensor_model_parallel_size ({tp}) x "
                         f"pipeline_model_parallel_size ({pp})")
    dp = world // (tp * pp)
    if ep < 1:
        raise ValueError(f"expert_model_parallel_size must be at least 1, got {ep}")
    if cp < 1 or dp % cp:
        raise ValueError(f"data-parallel size {dp} (world size {world} / tensor_model_parallel_size {tp} / "
                         f"pipeline_model_parallel_size {pp}) is not divisible by context_parallel_size ({cp})")
    if cp > 1 and ep > 1 and ep % cp and cp % ep:
        # both split the data-parallel dimension innermost: one's groups must hold whole groups of the other
        raise ValueError(f"context_parallel_size {cp} and expert_model_parallel_size {ep}: one must divide the "
                         f"other")
    if dp % ep:
        # EP splits the data-parallel dimension only: an EP group never spans TP ranks or stages
        raise ValueError(f"data-parallel size {dp} (world size {world} / tensor_model_parallel_size {tp} / "
                         f"pipeline_model_parallel_size {pp}) is not divisible by expert_model_parallel_size ({ep})")
    coords = [(r % tp, (r // tp) % dp, r // (tp * dp)) for r in range(world)]
    kinds = {
        "tp": lambda t, d, p: tuple(grid_rank(i, d, p, tp, dp) for i in range(tp)),
        "dp": lambda t, d, p: tuple(grid_rank(t, i, p, tp, dp) for i in range(dp)),
        "pp": lambda t, d, p: tuple(grid_rank(t, d, i, tp, dp) for i in range(pp)),
        "mp": lambda t, d, p: tuple(grid_rank(i, d, j, tp, dp) for j in range(pp) for i in range(tp)),
    }
    if pp > 1:
        kinds["embedding"] = lambda t, d, p: tuple(grid_rank(t, d, i, tp, dp) for i in sorted({0, pp - 1}))
    if ep > 1:  # dp_rank = expert_dp_rank * ep + ep_rank
        kinds["ep"] = lambda t, d, p: tuple(grid_rank(t, d // ep * ep + i, p, tp, dp) for i in range(ep))
        kinds["expert_dp"] = lambda t, d, p: tuple(grid_rank(t, d % ep + j * ep, p, tp, dp) for j in range(dp // ep))
    if cp > 1:  # dp_rank = sample_shard * cp + cp_rank
        kinds["cp"] = lambda t, d, p: tuple(grid_rank(t, d // cp * cp + i, p, tp, dp) for i in range(cp))
    return {name: sorted({members_of(*c) for c in coords}) for name, members_of in kinds.items()}


def build_grid(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
               expert_model_parallel_size: int = 1, context_parallel_size: int = 1) -> ParallelGrid:
    """Create every group of the grid (collective: all ranks call it with the same sizes)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    tp, pp, ep, cp = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size, \
        context_parallel_size
    groups = grid_groups(world, tp, pp, ep, cp)
    dp = world // (tp * pp)
    tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    mine = {}
    for name, keys in groups.items():
        # every rank creates every group, in the same order (new_group is collective)
        for key in keys:
            group = dist.new_group(list(key)) if len(key) < world else dist.group.WORLD
            if rank in key:
                mine[name] = group
    return ParallelGrid(tp, pp, dp, tp_rank, pp_rank, dp_rank, mine["tp"], mine["pp"], mine["dp"], mine["mp"],
                        mine.get("embedding"), [grid_rank(tp_rank, dp_rank, i, tp, dp) for i in range(pp)],
                        ep, dp_rank % ep, dp_rank // ep, mine.get("ep"), mine.get("expert_dp", mine["dp"]),
                        cp, dp_rank % cp, mine.get("cp"))


_GRID: ParallelGrid | None = None
_BUILT: dict[tuple[int, ...], ParallelGrid] = {}  # groups are costly to create: reuse them


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              expert_model_parallel_size: int = 1, context_parallel_size: int = 1) -> ParallelGrid:
    """Build the grid for this process (replacing an earlier one) and return it."""
    global _GRID
    key = (tensor_model_parallel_size, pipeline_model_parallel_size, dist.get_world_size(), expert_model_parallel_size,
           context_parallel_size)
    if key not in _BUILT:
        _BUILT[key] = build_grid(tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size,
                                 context_parallel_size)
    _GRID = _BUILT[key]
    return _GRID


def model_parallel_is_initialized() -> bool:
    """True once initialize_model_parallel() has run."""
    return _GRID is not None


def destroy_model_parallel() -> None:
    """Forget the grid (its groups stay valid until the process group is destroyed)."""
    global _GRID
    _GRID = None


def get_grid() -> ParallelGrid:
    """The grid built by initialize_model_parallel()."""
    if _GRID is None:
        raise RuntimeError("model parallelism is not initialized: call "
                           "megazero.parallel_state.initialize_model_parallel() first")
    return _GRID


def grid_from_mpu(mpu) -> ParallelGrid | None:
    """The grid behind an `mpu` given to megazero.initialize(): this module (or anything with
    get_grid()), or a DeepSpeed-style object with get_data_parallel_group() and optionally the
    tensor-parallel getters (no pipelining)."""
    if mpu is None:
        return None
    if hasattr(mpu, "get_grid"):
        return mpu.get_grid()
    dp_group = mpu.get_data_parallel_group()
    tp_group = mpu.get_tensor_model_parallel_group() if hasattr(mpu, "get_tensor_model_parallel_group") else None
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    return ParallelGrid(tp_size, 1, dist.get_world_size(dp_group), tp_rank, 0, dist.get_rank(dp_group), tp_group,
                        None, dp_group, tp_group, None, [dist.get_rank()], expert_dp_group=dp_group)


# ---- Megatron's mpu getters --------------------------------------------------------------
def get_tensor_model_parallel_group():
    """Process group of this rank's tensor-parallel peers."""
    return get_grid().tp_group


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor-parallel group."""
    return get_grid().tp_rank


def get_tensor_model_parallel_world_size() -> int:
    """Tensor-parallel degree."""
    return get_grid().tensor_model_parallel_size


def get_pipeline_model_parallel_group():
    """Process group of this rank's pipeline (one rank per stage)."""
    return get_grid().pp_group


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline stage."""
    return get_grid().pp_rank


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages."""
    return get_grid().pipeline_model_parallel_size


def get_data_parallel_group():
    """Process group over which ZeRO partitions and gradients are reduced (with CP: DP x CP)."""
    return get_grid().dp_group


def get_data_parallel_rank() -> int:
    """This rank's index in its data-parallel group."""
    return get_grid().dp_rank


def get_data_parallel_world_size() -> int:
    """Data-parallel degree."""
    return get_grid().data_parallel_size


def get_model_parallel_group():
    """All ranks holding a piece of this rank's model replica (TP x PP)."""
    return get_grid().model_parallel_group


def get_embedding_group():
    """First and last pipeline stage of this rank's pipeline (None without pipelining)."""
    return get_grid().embedding_group


def is_pipeline_first_stage() -> bool:
    """True on the first pipeline stage."""
    return get_grid().is_first_stage


def is_pipeline_last_stage() -> bool:
    """True on the last pipeline stage."""
    return get_grid().is_last_stage


def get_expert_model_parallel_group():
    """Process group of this rank's expert-parallel peers (they hold different experts; None at EP = 1)."""
    return get_grid().ep_group


def get_expert_model_parallel_rank() -> int:
    """This rank's index in its expert-parallel group."""
    return get_grid().ep_rank


def get_expert_model_parallel_world_size() -> int:
    """Expert-parallel degree."""
    return get_grid().expert_model_parallel_size


def get_expert_data_parallel_group():
    """Process group over which the expert parameters' gradients are reduced (and ZeRO partitions them)."""
    return get_grid().expert_dp_group


def get_expert_data_parallel_rank() -> int:
    """This rank's index in its expert-data-parallel group."""
    return get_grid().expert_dp_rank


def get_expert_data_parallel_world_size() -> int:
    """Expert-data-parallel degree (DP / EP)."""
    return get_grid().expert_data_parallel_size


def get_context_parallel_group():
    """Process group of this rank's context-parallel peers (they split each sample's sequence; None at CP = 1)."""
    return get_grid().cp_group


def get_context_parallel_rank() -> int:
    """This rank's index in its context-parallel group."""
    return get_grid().cp_rank


def get_context_parallel_world_size() -> int:
    """Context-parallel degree."""
    return get_grid().context_parallel_size
