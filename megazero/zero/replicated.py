"""ZeRO stage 0 (plain data parallelism): every rank holds everything; gradients are all-reduced.

Its checkpoint format (`replicated`, one `mp_rank_*_optim_states.pt` per tensor rank and pipeline
stage, written by data-parallel rank 0): the optimizer state dict, the global names of the
parameters in optimizer order, and the fp32 masters (None for an fp32 model: the model file's
weights are the masters)."""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from megazero.distributed import all_reduce_sum
from megazero.precision import MasterParams
from megazero.zero.averaging import SUM_THEN_AVERAGE, GradientAveraging
from megazero.zero.buckets import BucketedGradients
from megazero.zero.collectives import Handle, all_reduce
from megazero.zero.layout import FlatLayout
from megazero.zero.master_partitions import SquaredNormSum
from megazero.zero.protocol import (
    REPLICATED_FORMAT,
    ExportedParameterStates,
    optimizer_state,
    register_checkpoint_format,
)


def _per_element(value) -> bool:
    return torch.is_tensor(value) and value.dim() > 0


def export_replicated(saved: list[dict], module: dict[str, torch.Tensor]) -> ExportedParameterStates:
    """Whole per-parameter states from the one file of a replicated state (16-bit models: its fp32
    masters; fp32 models: the module's weights)."""
    (optim,) = saved
    names = optim["param_names"]
    masters = optim["master_params"] or [module[n] for n in names]
    out = ExportedParameterStates(weights={n: t.float() for n, t in zip(names, masters)})
    state = optim["optimizer"]
    for gi, group in enumerate(state["param_groups"]):
        for index in group["params"]:
            out.group_of[names[index]] = gi
            out.optimizer[names[index]] = dict(state["state"].get(index, {}))
    out.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    return out


class ReplicatedState:
    """fp32 gradient buffer all-reduced in buckets; fp32 master weights (copies for 16-bit models)."""

    stage = 0
    gradients_partitioned = False
    checkpoint_format = REPLICATED_FORMAT
    state_partitioned = False
    params_partitioned = False
    export_parameter_states = staticmethod(export_replicated)

    def __init__(self, groups: list[list[torch.nn.Parameter]], group, bucket_numel: int, overlap: bool,
                 grad_divisor: int | None = None, averaging: GradientAveraging = SUM_THEN_AVERAGE):
        self.group = group
        self.world_size = dist.get_world_size(group)
        params = [p for g in groups for p in g]
        self.master = MasterParams(params)
        self.layout = FlatLayout(params, bucket_numel, 1)
        # grad_divisor: what the summed gradients are divided by (default: the group's size)
        self.grads = BucketedGradients(self.layout, self._all_reduce, self.world_size, overlap, divisor=grad_divisor,
                                       averaging=averaging)
        # True while the optimizer averages over the group itself (megazero.optim.protocol.
        # DataParallelAverager, e.g. 1-bit Adam once compressing): gradients stay this rank's own
        self.local_gradients = False

    def _all_reduce(self, bucket, tensor: torch.Tensor) -> Handle:
        inner = all_reduce(tensor, self.group, f"gradient bucket {bucket.index}")
        after = self.grads.after
        return inner if after == 1 else Handle([inner], lambda: tensor.mul_(after))

    def optimizer_groups(self, groups: list[dict]) -> list[dict]:
        """The optimizer's param groups, over the fp32 master weights."""
        return [{**g, "params": [self.master.master_of(p) for p in g["params"]]} for g in groups]

    def optimizer_to_step(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """`optimizer` itself: it steps the masters where they are."""
        return optimizer

    @property
    def bucket_count(self) -> int:
        """How many buckets the gradient buffer is cut into."""
        return self.grads.bucket_count

    def begin_micro_step(self, boundary: bool, defer: bool = False) -> None:
        """Communicate during this backward only on the accumulation boundary (never with local
        gradients, nor deferred ones)."""
        self.grads.sync_this_micro_step = boundary and not (self.local_gradients or defer)

    def after_backward(self, boundary: bool, defer: bool = False) -> None:
        """Nothing to do between micro-steps: gradients accumulate locally."""

    def reduce_gradients(self) -> None:
        """Finish the all-reduce of every bucket (local gradients: none was started)."""
        if self.local_gradients:
            self.grads.finish_local()
        else:
            self.grads.finish_reduction()

    def grad_norm_squared(self, counted=None) -> torch.Tensor:
        """Squared L2 norm of the reduced gradients of the parameters with counted(p) true (all when
        None), as a float64 scalar: every data-parallel rank holds the whole reduced gradient."""
        local = SquaredNormSum()
        if counted is None:
            local.add([self.grads.buffer])
        else:
            local.add([self.grads.grad(p) for p in self.layout.params if counted(p)])
        return local.total()

    def grad_norm(self, counted=None, model_parallel_group=None) -> float:
        """Global L2 norm of the (loss-scaled) gradients; inf/nan on overflow. Every data-parallel rank
        holds the whole reduced gradient; with model parallelism the parameters for which counted(p)
        is true are summed over the model-parallel group."""
        total = self.grad_norm_squared(counted)
        if model_parallel_group is not None:
            total = all_reduce_sum(total, group=model_parallel_group)
        if self.local_gradients and self.world_size > 1:
            # this rank's norm clips its own gradients (as DeepSpeed's 1-bit optimizers do), but an
            # inf/nan on any rank skips the step on every rank
            anywhere = all_reduce_sum(torch.logical_not(torch.isfinite(total)).double(), group=self.group)
            total = torch.where(anywhere.to(total.device) > 0, math.inf, total)
        return total.item() ** 0.5  # the step's one host sync: it decides skip and clip

    def nonfinite_params(self) -> list[torch.nn.Parameter]:
        """The parameters whose reduced gradient holds an inf or nan (for the error that stops a run)."""
        return [p for p in self.layout.params if not bool(torch.isfinite(self.grads.grad(p)).all())]

    def sync_grads(self, params: list[torch.nn.Parameter], group) -> None:
        """Sum the reduced gradients of `params` over `group` (tied weights on other pipeline stages)."""
        for p in params:
            dist.all_reduce(self.grads.grad(p), group=group)

    def scale_gradients(self, factor: float) -> None:
        """Multiply all gradients by `factor` (unscale and clip for optimizers that cannot)."""
        self.grads.buffer.mul_(factor)

    def attach_grads(self) -> None:
        """Point each master weight's .grad at its reduced gradient."""
        self.master.attach_grads(self.grads)

    def detach_grads(self) -> None:
        """Drop the gradient views from the master weights."""
        self.master.detach_grads()

    def copy_targets(self) -> dict[int, torch.Tensor]:
        """{id(master): the 16-bit model tensor it is cast into} (empty for an fp32 model)."""
        if not all(p.dtype in (torch.bfloat16, torch.float16) for p in self.master.model_params):
            return {}
        return {id(m): p.data for m, p in zip(self.master.params, self.master.model_params)}

    def update_model(self, copies_written: bool = False) -> None:
        """Write the updated master weights into the model (unless the optimizer already did)."""
        if not copies_written:
            self.master.copy_to_model()

    def reset_masters(self) -> None:
        """Re-read the master weights from the model (after loading model weights only)."""
        self.master.copy_from_model()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by kind (for memory reports)."""
        return {"parameters": list(self.master.model_params), "gradients": [self.grads.buffer],
                "optimizer": list(self.master.params) if self.master.separate else []}

    def start_window(self) -> None:
        """Discard gradients and start the next accumulation window."""
        self.grads.start_window()

    # ---- checkpoint (megazero.zero.protocol) ---------------------------------------------------
    def parameter_shapes(self) -> dict[int, torch.Size]:
        """{id(param): shape}: every parameter is whole."""
        return {id(p): p.shape for p in self.layout.params}

    def gathered(self, params: list[torch.nn.Parameter]) -> AbstractContextManager:
        """Every parameter is whole already."""
        return nullcontext()

    def state_dict(self, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict:
        """The optimizer's state, the parameters' names in its order and the fp32 masters (16-bit models)."""
        master = self.master
        return {"optimizer": optimizer.state_dict(),
                "param_names": [names[id(p)] for p in master.model_params],
                "master_params": [p.detach() for p in master.params] if master.separate else None}

    def same_layout(self, state: dict, names: dict[int, str]) -> bool:
        """Every rank holds everything: any file of the same TP/PP/DP layout is this one's."""
        return True

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        """Restore the optimizer and the fp32 masters (16-bit models; fp32 ones were loaded with the module)."""
        optimizer.load_state_dict(state["optimizer"])
        master = self.master
        if master.separate:
            with torch.no_grad():
                for param, saved in zip(master.params, state["master_params"]):
                    param.copy_(saved)
            master.copy_to_model()

    def load_parameter_states(self, optimizer: torch.optim.Optimizer, weights: dict[int, torch.Tensor],
                              states: dict[int, dict[str, Any]] | None, param_groups: list[dict]) -> None:
        """Masters (and model) from the whole weights; the optimizer's per-parameter states."""
        master = self.master
        with torch.no_grad():
            for model_param, master_param in zip(master.model_params, master.params):
                master_param.copy_(weights[id(model_param)].view_as(master_param))
        master.copy_to_model()
        if states is None:
            return
        per_index = {}
        for i, p in enumerate(master.model_params):
            saved = states[id(p)]
            entry = {**{k: v.clone() if torch.is_tensor(v) else v for k, v in saved.items() if not _per_element(v)},
                     **{k: v.reshape(p.shape).clone() for k, v in saved.items() if _per_element(v)}}
            if entry:
                per_index[i] = entry
        optimizer.load_state_dict(optimizer_state(optimizer, per_index, param_groups))


register_checkpoint_format(REPLICATED_FORMAT, export_replicated)
