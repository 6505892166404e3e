"""torch APIs that differ between the torch versions megazero supports, in one place.

The oldest supported torch is 2.11 (pyproject.toml; the GPU machines' image has it, and
`make test-torch-min` runs the fast suite under it); `make install` pins a newer one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TORCH_MIN = "2.11"
# reduce_scatter_single came after torch 2.11
_NATIVE_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Sum the flat `input` (group size x output.numel() elements) over `group`; `output` gets this
    rank's chunk of the sum. torch's own where it has it, else reduce_scatter_by_chunks."""
    (_NATIVE_REDUCE_SCATTER_SINGLE or reduce_scatter_by_chunks)(output, input, group=group)


def reduce_scatter_by_chunks(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """reduce_scatter_single by megazero's reduce-scatter (native on NCCL, point-to-point on gloo:
    megazero.zero.collectives), for a torch without it."""
    from megazero.zero.collectives import reduce_scatter_chunks

    buffer = input.clone()  # reduced in place
    reduce_scatter_chunks(buffer, group).wait()
    output.copy_(buffer.view(dist.get_world_size(group), -1)[dist.get_rank(group)])
