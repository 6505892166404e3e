"""Expert parallelism in the data-parallel state: dense parameters over the data-parallel group,
expert parameters over the expert-data-parallel group, each by its own state of the same ZeRO stage.

An expert parameter (`param.megazero_expert = True`, set by megazero.moe) is a stack of this
rank's E/EP experts along dim 0; the ranks of the expert-parallel (EP) group hold different
experts, the ranks of the expert-data-parallel group (DP / EP of them) the same ones.

Gradients. The single-process reference minimises the mean loss over the global batch. On a
data-parallel rank the loss is the mean over its 1/DP of that batch, so a dense gradient is
summed over DP and divided by DP. An expert's gradient on its EP rank already sums, through the
all-to-all's backward, the contributions of all EP ranks' tokens; the expert-DP group's copies
together have seen every DP rank's tokens once. So expert gradients are summed over the
expert-DP group and divided by the whole DP size (not DP / EP), as Megatron core does.

ZeRO 1-3 partition each state over its own group (separate flat layouts and buckets), so an
expert is never gathered over ranks that hold other experts. At ZeRO-3 both states are
ShardedStates over the same model: the expert modules' units belong to the expert state (gathered
over the expert-DP group, prefetched in the order of the expert units), the rest to the dense one,
and one UnitHooks over both states' units fetches each unit through its own state's fetcher.
Optimizer offload wraps each state in its own OffloadedState (its own swap files and sub-groups);
the optimizer the engine steps steps both (OffloadedOptimizer over the two). The gradient norm
(clip and overflow) counts each parameter once: the dense state's squared norm plus the expert
state's summed over the EP group, then over the model-parallel group as usual.

Checkpoints (format `expert_parallel`): every data-parallel rank writes its file, holding both
states' own state_dict()s and the weights of replicated states; the model file holds no
parameters (`params_partitioned`: they are not the same on every data-parallel rank). At another
layout the exporter joins the experts of the EP ranks along dim 0, so the per-parameter states
carry all E experts in global order; load_parameter_states cuts this rank's rows again, so a
checkpoint loads at any EP size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from megazero.distributed import all_reduce_sum
from megazero.model_contract import is_expert_parameter
from megazero.zero.offload import OffloadedOptimizer
from megazero.zero.protocol import (
    DataParallelState,
    ExportedParameterStates,
    export_parameter_states,
    register_checkpoint_format,
)

EXPERT_PARALLEL_FORMAT = "expert_parallel"
EXPERT_DIM = 0  # the dimension along which an expert parameter stacks its experts


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


# ---- the checkpoint format ---------------------------------------------------------------------
def _export(files: list[dict], key: str) -> ExportedParameterStates:
    """Whole per-parameter states of one of the states (`key`) from its files (rank order)."""
    parts = [f[key] for f in files]
    partitioned = files[0][f"{key}_partitioned"]
    module = {}
    if not partitioned:  # a replicated state's weights, under the names of its own file
        parts = parts[:1]
        module = dict(zip(parts[0]["param_names"], files[0][f"{key}_weights"]))
    return export_parameter_states(parts, module, partitioned)


def _join_experts(per_rank: list[ExportedParameterStates]) -> ExportedParameterStates:
    """One ExportedParameterStates with all experts: each EP rank's rows joined along dim 0."""
    first = per_rank[0]
    out = ExportedParameterStates(group_of=dict(first.group_of), param_groups=first.param_groups)
    for name in first.weights:
        out.weights[name] = torch.cat([e.weights[name] for e in per_rank], dim=EXPERT_DIM)
        out.optimizer[name] = {k: torch.cat([e.optimizer[name][k] for e in per_rank], dim=EXPERT_DIM)
                               if torch.is_tensor(v) and v.dim() > 0 else v for k, v in first.optimizer[name].items()}
    return out


def export_expert_parallel(saved: list[dict], module: dict[str, torch.Tensor]) -> ExportedParameterStates:
    """Whole per-parameter states from every data-parallel rank's file (rank order), experts in
    global order (EP rank r's rows are experts [r * E/EP, (r + 1) * E/EP)); ValueError when files are
    missing."""
    dp, ep = saved[0]["dp_world_size"], saved[0]["ep_size"]
    if len(saved) != dp or [s["dp_rank"] for s in saved] != list(range(dp)):
        raise ValueError(f"{len(saved)} expert-parallel state files, but they were written by {dp} ranks")
    out = ExportedParameterStates()
    if saved[0]["dense"] is not None:
        out = _export(saved, "dense")
    if saved[0]["expert"] is not None:
        # ranks with the same EP index hold the same experts (dp_rank = expert_dp_rank * ep + ep_rank)
        experts = _join_experts([_export([s for s in saved if s["ep_rank"] == r], "expert") for r in range(ep)])
        offset = len(out.param_groups)
        out.weights.update(experts.weights)
        out.optimizer.update(experts.optimizer)
        out.group_of.update({name: g + offset for name, g in experts.group_of.items()})
        out.param_groups = out.param_groups + experts.param_groups
    return out


register_checkpoint_format(EXPERT_PARALLEL_FORMAT, export_expert_parallel)


class _OptimizerView:
    """One state's slice of the shared optimizer: its param groups, state indices renumbered from 0
    (torch numbers parameters consecutively over the groups). The states' checkpoint members read
    it with state_dict(); what they load_state_dict() is kept, for the composite to load at once."""

    def __init__(self, optimizer: torch.optim.Optimizer, first_group: int, num_groups: int):
        self.optimizer = optimizer
        self.groups = range(first_group, first_group + num_groups)
        self.loaded: dict | None = None

    def _offset(self, full: dict) -> int:
        return sum(len(full["param_groups"][g]["params"]) for g in range(self.groups.start))

    def state_dict(self) -> dict:
        """The slice of optimizer.state_dict()."""
        full = self.optimizer.state_dict()
        offset = self._offset(full)
        groups = [{**full["param_groups"][g], "params": [i - offset for i in full["param_groups"][g]["params"]]}
                  for g in self.groups]
        wanted = {i for g in groups for i in g["params"]}
        return {"state": {i - offset: v for i, v in full["state"].items() if i - offset in wanted},
                "param_groups": groups}

    def load_state_dict(self, state: dict) -> None:
        """Keep the slice to load (see ExpertParallelState._load_optimizer)."""
        self.loaded = state


# (param groups, process group, grad divisor or None for the group's size, isolated parameters) ->
# the state of this ZeRO stage over them (megazero.zero.factory)
InnerBuilder = Callable[[list[list[torch.nn.Parameter]], Any, "int | None", list[torch.nn.Parameter]],
                        DataParallelState]


class ExpertParallelState:
    """Two data-parallel states of one ZeRO stage: `dense` over the data-parallel group, `expert`
    over the expert-data-parallel group (a megazero.zero.protocol.DataParallelState; module docstring)."""

    checkpoint_format = EXPERT_PARALLEL_FORMAT
    state_partitioned = True  # the experts differ between data-parallel ranks: each writes its file
    params_partitioned = True  # so the model file cannot hold them; the state files do
    export_parameter_states = staticmethod(export_expert_parallel)

    def __init__(self, groups: list[list[torch.nn.Parameter]], stage: int, dp_group, ep_group, expert_dp_group,
                 build_inner: InnerBuilder, isolate: list[torch.nn.Parameter] = ()):
        self.stage = stage
        self.dp_group, self.ep_group = dp_group, ep_group
        self.expert_dp_group = expert_dp_group if expert_dp_group is not None else dp_group
        self.dp_size, self.ep_size, self.ep_rank = _size(dp_group), _size(ep_group), _rank(ep_group)
        if any(is_expert_parameter(p) for p in isolate):
            raise ValueError("a tied parameter is an expert parameter: tied weights must be dense")
        self._dense_groups = [i for i, g in enumerate(groups) if any(not is_expert_parameter(p) for p in g)]
        self._expert_groups = [i for i, g in enumerate(groups) if any(is_expert_parameter(p) for p in g)]
        dense = [[p for p in groups[i] if not is_expert_parameter(p)] for i in self._dense_groups]
        experts = [[p for p in groups[i] if is_expert_parameter(p)] for i in self._expert_groups]

        self.dense = build_inner(dense, dp_group, None, isolate) if dense else None
        # summed over the expert-DP group, divided by the whole DP size (module docstring)
        self.expert = build_inner(experts, self.expert_dp_group, self.dp_size, ()) if experts else None
        self._states = [s for s in (self.dense, self.expert) if s is not None]
        self.gradients_partitioned = self._states[0].gradients_partitioned  # (both states of one stage)
        self._num_groups = (len(dense), len(experts))

    # ---- training ----------------------------------------------------------------------------
    @property
    def bucket_count(self) -> int:
        """Gradient reductions per accumulation window, both states."""
        return sum(s.bucket_count for s in self._states)

    def optimizer_groups(self, groups: list[dict]) -> list[dict]:
        """The dense param groups' masters, then the expert param groups' (each keeps its options)."""
        out = []
        for state, indices, expert in ((self.dense, self._dense_groups, False),
                                       (self.expert, self._expert_groups, True)):
            if state is not None:
                out += state.optimizer_groups([{**groups[i], "params": [p for p in groups[i]["params"]
                                                                         if is_expert_parameter(p) == expert]}
                                               for i in indices])
        return out

    def optimizer_to_step(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """`optimizer` itself, where both states keep their masters in memory; with optimizer offload,
        one OffloadedOptimizer stepping both states' sub-groups."""
        offloaded = [o for o in (s.optimizer_to_step(optimizer) for s in self._states) if o is not optimizer]
        return OffloadedOptimizer.joined(optimizer, offloaded) if offloaded else optimizer

    def begin_micro_step(self, boundary: bool, defer: bool = False) -> None:
        """Both states."""
        for s in self._states:
            s.begin_micro_step(boundary, defer)

    def after_backward(self, boundary: bool, defer: bool = False) -> None:
        """Both states."""
        for s in self._states:
            s.after_backward(boundary, defer)

    def reduce_gradients(self) -> None:
        """Finish both states' reductions."""
        for s in self._states:
            s.reduce_gradients()

    def grad_norm(self, counted=None, model_parallel_group=None) -> float:
        """Global L2 norm: the dense squared norm plus the expert one summed over the EP group (each
        EP rank holds other experts; the router and other dense parameters are counted once), then
        over the model-parallel group; inf/nan on overflow anywhere."""
        total = torch.zeros((), dtype=torch.float64)
        if self.dense is not None:
            total = self.dense.grad_norm_squared(counted)
        if self.expert is not None:
            experts = self.expert.grad_norm_squared(counted)
            if self.ep_size > 1:
                experts = all_reduce_sum(experts, group=self.ep_group)
            total = total + experts.to(total.device)
        if model_parallel_group is not None:
            total = all_reduce_sum(total, group=model_parallel_group)
        return total.item() ** 0.5  # the step's one host sync: it decides skip and clip

    def nonfinite_params(self) -> list[torch.nn.Parameter]:
        """Both states' parameters with an inf or nan in this rank's reduced gradient."""
        return [p for s in self._states for p in s.nonfinite_params()]

    def sync_grads(self, params: list[torch.nn.Parameter], group) -> None:
        """Tied weights are dense: summed by the dense state."""
        self.dense.sync_grads(params, group)

    def scale_gradients(self, factor: float) -> None:
        """Both states."""
        for s in self._states:
            s.scale_gradients(factor)

    def attach_grads(self) -> None:
        """Both states."""
        for s in self._states:
            s.attach_grads()

    def detach_grads(self) -> None:
        """Both states."""
        for s in self._states:
            s.detach_grads()

    def copy_targets(self) -> dict[int, torch.Tensor]:
        """Both states' {id(master): 16-bit tensor}, or none when either has none (all or nothing)."""
        targets = [s.copy_targets() for s in self._states]
        return {k: v for t in targets for k, v in t.items()} if all(targets) else {}

    def update_model(self, copies_written: bool = False) -> None:
        """Both states."""
        for s in self._states:
            s.update_model(copies_written)

    def reset_masters(self) -> None:
        """Both states."""
        for s in self._states:
            s.reset_masters()

    def start_window(self) -> None:
        """Both states."""
        for s in self._states:
            s.start_window()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Both states' tensors, by kind."""
        out: dict[str, list[torch.Tensor]] = {}
        for s in self._states:
            for kind, tensors in s.memory_tensors().items():
                out.setdefault(kind, []).extend(tensors)
        return out

    # ---- model shapes ------------------------------------------------------------------------
    def parameter_shapes(self) -> dict[int, torch.Size]:
        """Both states' shapes (an expert parameter's: this rank's experts)."""
        return {k: v for s in self._states for k, v in s.parameter_shapes().items()}

    @contextmanager
    def gathered(self, params: list[torch.nn.Parameter]):
        """`params` whole inside: each state's gathered() (ZeRO-3: their units), then the expert
        parameters among them hold all E experts (all-gathered over the EP group)."""
        with contextlib.ExitStack() as stack:
            for state, expert in ((self.dense, False), (self.expert, True)):
                if state is not None:
                    stack.enter_context(state.gathered([p for p in params if is_expert_parameter(p) == expert]))
            with self._all_experts(params):
                yield

    @contextmanager
    def _all_experts(self, params: list[torch.nn.Parameter]):
        experts = [p for p in params if is_expert_parameter(p)] if self.ep_size > 1 else []
        local = [p.data for p in experts]
        try:
            for p in experts:
                pieces = [torch.empty_like(p.data) for _ in range(self.ep_size)]
                dist.all_gather(pieces, p.data.contiguous(), group=self.ep_group)
                p.data = torch.cat(pieces, dim=EXPERT_DIM)
            yield
        finally:
            for p, data in zip(experts, local):
                p.data = data

    # ---- checkpoint --------------------------------------------------------------------------
    def _named(self, optimizer: torch.optim.Optimizer) -> list[tuple[str, Any, _OptimizerView, list[dict] | None]]:
        """(key, state, its optimizer view) of each state, dense first (their optimizer order)."""
        out, first = [], 0
        for key, state, count in (("dense", self.dense, self._num_groups[0]), ("expert", self.expert,
                                                                                self._num_groups[1])):
            if state is not None:
                out.append((key, state, _OptimizerView(optimizer, first, count)))
                first += count
        return out

    def state_dict(self, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict:
        """Both states' files in one, with this rank's place in the grid; a replicated state's
        weights too (in its own order: an fp32 one saves no masters, the model file none either)."""
        out = {"checkpoint_format": EXPERT_PARALLEL_FORMAT, "zero_stage": self.stage, "dp_world_size": self.dp_size,
               "dp_rank": _rank(self.dp_group), "ep_size": self.ep_size, "ep_rank": self.ep_rank,
               "dense": None, "expert": None}
        for key, state, view in self._named(optimizer):
            out[key] = state.state_dict(view, names)
            out[f"{key}_partitioned"] = state.state_partitioned
            out[f"{key}_weights"] = None if state.state_partitioned else [
                p.detach().clone() for p in state.master.model_params]
        return out

    def same_layout(self, state: dict, names: dict[int, str]) -> bool:
        """True when `state` was written by this partitioning (same DP and EP sizes, same states)."""
        if state.get("checkpoint_format") != EXPERT_PARALLEL_FORMAT:
            return False
        if (state["dp_world_size"], state["ep_size"], state["ep_rank"]) != (self.dp_size, self.ep_size, self.ep_rank):
            return False
        for key, own in (("dense", self.dense), ("expert", self.expert)):
            if (state[key] is None) != (own is None) or (own is not None and not own.same_layout(state[key], names)):
                return False
        return True

    @staticmethod
    def _load_optimizer(optimizer: torch.optim.Optimizer, views: list[_OptimizerView]) -> None:
        """Load what the states loaded into their views as one optimizer state dict."""
        if all(v.loaded is None for v in views):
            return
        merged, offset = {"state": {}, "param_groups": []}, 0
        for view in views:
            loaded = view.loaded if view.loaded is not None else view.state_dict()
            merged["state"].update({i + offset: v for i, v in loaded["state"].items()})
            merged["param_groups"] += [{**g, "params": [i + offset for i in g["params"]]}
                                       for g in loaded["param_groups"]]
            offset += sum(len(g["params"]) for g in loaded["param_groups"])
        optimizer.load_state_dict(merged)

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        """Inverse of state_dict() (same layout): a replicated state's weights, then each state."""
        named = self._named(optimizer)
        for key, s, view in named:
            weights = state.get(f"{key}_weights")
            if weights is not None:
                with torch.no_grad():
                    for p, saved in zip(s.master.model_params, weights):
                        p.copy_(saved)
                s.reset_masters()
            s.load_state_dict(state[key], view)
        self._load_optimizer(optimizer, [view for _, _, view in named])

    def _local_experts(self, whole: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """This EP rank's rows of an expert tensor that holds all E experts (dim 0, global order)."""
        if whole.dim() == 0:
            return whole
        local = shape[EXPERT_DIM]
        if whole.shape[EXPERT_DIM] != local * self.ep_size:
            raise ValueError(f"an expert parameter of local shape {tuple(shape)} at expert-parallel size "
                             f"{self.ep_size} expects {local * self.ep_size} experts, the checkpoint has "
                             f"{whole.shape[EXPERT_DIM]} (shape {tuple(whole.shape)})")
        return whole.narrow(EXPERT_DIM, self.ep_rank * local, local).clone()

    def load_parameter_states(self, optimizer: torch.optim.Optimizer, weights: dict[int, torch.Tensor],
                              states: dict[int, dict[str, Any]] | None, param_groups: list[dict]) -> None:
        """Each state from the whole per-parameter states; expert tensors (all E experts) cut to this
        EP rank's experts first. `param_groups`: the dense groups' hyperparameters, then the experts'."""
        named = self._named(optimizer)
        first = 0
        for key, s, view in named:
            shapes = s.parameter_shapes()

            def mine(i, t, key=key, shapes=shapes):
                if key != "expert" or not torch.is_tensor(t):
                    return t
                return self._local_experts(t, shapes[i])

            own_weights = {i: mine(i, weights[i]) for i in shapes}
            own_states = None if states is None else {i: {k: mine(i, v) for k, v in states[i].items()} for i in shapes}
            count = len(view.groups)
            s.load_parameter_states(view, own_weights, own_states, param_groups[first:first + count])
            first += count
        self._load_optimizer(optimizer, [view for _, _, view in named])
