"""The experts one EP rank holds, computed as one grouped batch.

`GroupedExperts` holds E_local = E / EP experts with global indices [first_expert,
first_expert + E_local), their weights stacked along dim 0 (nn.Linear's [out, in] per expert):

    activation "gelu" (GPT):    fc1_weight [E_local, F, H], fc1_bias [E_local, F],
                                fc2_weight [E_local, H, F], fc2_bias [E_local, H];  fc2(gelu(fc1(x)))
    activation "swiglu" (Llama): fc1_weight [E_local, 2F, H] ([gate; up] rows), fc2_weight [E_local, H, F],
                                no biases;  fc2(silu(gate(x)) * up(x))

Row i of a stacked parameter is global expert first_expert + i, so a checkpoint maps it back with
`first_expert` (also on each parameter as `megazero_expert_first`, with `megazero_num_experts` = E
and the expert dimension 0): `merge_expert_slices` puts the EP ranks' tensors back into the
[E, ...] tensor of global indices, `expert_slice` cuts rank r's out of it at any EP size.
Every expert parameter carries `megazero_expert = True`: it exists on one EP rank only, so its
gradient is reduced over the expert-data-parallel group, not the whole data-parallel group.

Initialisation builds all E experts' weights from the default generator (seeded alike on every
rank) and keeps this rank's slice, so with the same seed rank r's experts are exactly experts
[first_expert, +E_local) of the EP=1 layer: every layout starts from the same model.

Grouped batch: the rows of each expert (contiguous, as dispatch returns them) are placed in a
zero-padded [E_local, M, H] block, M the largest row count of a local expert (at most the
capacity in capacity mode; in dropless mode whatever the router sent), and every expert runs in
one torch.bmm per weight; the padding rows are computed and thrown away.

Tensor parallelism inside the experts (`tp_group`): fc1 is
column-parallel (each TP rank holds F/TP of its rows, [gate; up] split with stride 2 for SwiGLU)
and fc2 row-parallel (the matching columns), the partial outputs summed over the TP group before
fc2's bias, exactly as the dense MLP; the tokens are the same on every TP rank (under sequence
parallelism the layer gathers the sequence first: megazero/moe/sequence.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazero.moe.comm import group_rank, group_size
from megazero.tensor_parallel.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from megazero.tensor_parallel.utils import divide, set_tensor_parallel_attributes, shard_of

ACTIVATIONS = ("gelu", "swiglu")
InitMethod = Callable[[torch.Tensor], object]


def _normal(std: float) -> InitMethod:
    return lambda t: nn.init.normal_(t, mean=0.0, std=std)


def expert_slice(full: torch.Tensor, ep_size: int, ep_rank: int) -> torch.Tensor:
    """EP rank ep_rank's experts [r*E/EP, (r+1)*E/EP) of a stacked [E, ...] expert tensor (a view)."""
    if full.shape[0] % ep_size:
        raise ValueError(f"num_experts {full.shape[0]} is not divisible by the expert-parallel size {ep_size}")
    per_rank = full.shape[0] // ep_size
    return full[ep_rank * per_rank:(ep_rank + 1) * per_rank]


def merge_expert_slices(slices: list[torch.Tensor]) -> torch.Tensor:
    """The [E, ...] tensor of global expert indices from every EP rank's slice, in EP rank order."""
    return torch.cat(slices, dim=0)


class GroupedExperts(nn.Module):
    """E_local MLP experts (see the module docstring for the layout, naming and initialisation)."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str = "gelu",
                 ep_group=None, tp_group=None, init_std: float = 0.02, output_init_std: float = 0.02):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"moe activation must be one of {ACTIVATIONS}, got {activation!r}")
        ep, tp = group_size(ep_group), group_size(tp_group)
        if num_experts % ep:
            raise ValueError(f"num_experts {num_experts} is not divisible by the expert-parallel size {ep}")
        self.num_experts, self.activation, self.ep_group, self.tp_group = num_experts, activation, ep_group, tp_group
        self.num_local_experts = num_experts // ep
        self.first_expert = group_rank(ep_group) * self.num_local_experts
        divide(ffn_hidden_size, tp, "moe ffn_hidden_size")
        gated = activation == "swiglu"
        rows = (2 if gated else 1) * ffn_hidden_size
        self.fc1_weight = self._expert_parameter((num_experts, rows, hidden_size), _normal(init_std), 1,
                                                 2 if gated else 1)
        self.fc2_weight = self._expert_parameter((num_experts, hidden_size, ffn_hidden_size),
                                                 _normal(output_init_std), 2)
        if gated:
            self.fc1_bias = self.fc2_bias = None
        else:
            self.fc1_bias = self._expert_parameter((num_experts, rows), nn.init.zeros_, 1)
            self.fc2_bias = self._expert_parameter((num_experts, hidden_size), nn.init.zeros_, None)

    def _expert_parameter(self, shape: tuple[int, ...], init: InitMethod, tp_dim: int | None,
                          stride: int = 1) -> nn.Parameter:
        """All experts' tensor built with `init`; this rank's experts (and TP shard) kept."""
        full = torch.empty(shape)
        with torch.no_grad():
            init(full)
        local = expert_slice(full, group_size(self.ep_group), group_rank(self.ep_group))
        tp = group_size(self.tp_group)
        if tp_dim is not None and tp > 1:
            local = shard_of(local, tp_dim, tp, group_rank(self.tp_group), stride)
        param = nn.Parameter(local.clone())
        if tp_dim is not None:
            set_tensor_parallel_attributes(param, tp_dim, stride)
        param.megazero_expert = True
        param.megazero_expert_first = self.first_expert
        param.megazero_num_experts = self.num_experts
        return param

    def global_expert_indices(self) -> range:
        """Global indices of the experts held here (row i of each parameter is expert first + i)."""
        return range(self.first_expert, self.first_expert + self.num_local_experts)

    def forward(self, rows: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
        """rows [N, H], the first rows_per_expert[0] for local expert 0, and so on -> outputs [N, H]."""
        if rows.shape[0] == 0:  # no tokens here; keep the parameters in the graph (zero gradient)
            return rows + 0.0 * sum(p.sum() for p in self.parameters())
        counts = torch.tensor(rows_per_expert, device=rows.device)
        width = int(counts.max())
        expert = torch.repeat_interleave(torch.arange(len(rows_per_expert), device=rows.device), counts)
        position = torch.arange(rows.shape[0], device=rows.device) - (torch.cumsum(counts, 0) - counts)[expert]
        slot = expert * width + position  # row -> its place in the padded [E_local, width] block
        x = copy_to_tensor_parallel_region(rows, self.tp_group)
        padded = x.new_zeros((self.num_local_experts * width, x.shape[1])).index_copy(0, slot, x)
        h = torch.bmm(padded.view(self.num_local_experts, width, -1), self.fc1_weight.transpose(1, 2))
        if self.fc1_bias is not None:
            h = h + self.fc1_bias.unsqueeze(1)
        if self.activation == "gelu":
            h = F.gelu(h, approximate="tanh")
        else:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        y = reduce_from_tensor_parallel_region(torch.bmm(h, self.fc2_weight.transpose(1, 2)), self.tp_group)
        if self.fc2_bias is not None:
            y = y + self.fc2_bias.unsqueeze(1)
        return y.reshape(self.num_local_experts * width, -1)[slot]

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1} of "
                f"{self.num_experts}, activation={self.activation}")
