"""The data-parallel state protocol (megazero.zero.protocol): the three states implement it, its
re-cut carries weights and optimizer states from every stage to every other one, and checkpoint/
reaches the states only through it."""

from __future__ import annotations

import pathlib
import re

import torch
import torch.distributed as dist

from megazero.config import validate_config
from megazero.zero import PartitionedState, ReplicatedState, ShardedState, build_data_parallel_state
from megazero.zero.protocol import DataParallelState, export_parameter_states

MEGAZERO = pathlib.Path(__file__).resolve().parents[2] / "megazero"
CHECKPOINT = MEGAZERO / "checkpoint"
# what wraps or drives a state: it may use the protocol's members only
WRAPPERS = ["zero/offload.py", "zero/param_offload.py", "zero/expert_parallel.py"]
ENGINE = ["engine.py", "engine_api.py", "__init__.py"]
KINDS = {0: ReplicatedState, 1: PartitionedState, 2: PartitionedState, 3: ShardedState}


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(7, 7) for _ in range(2))  # odd sizes: padding
        self.head = torch.nn.Linear(7, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _build(stage: int, seed: int):
    torch.manual_seed(seed)
    model = _Tiny()
    params = list(model.parameters())
    config = validate_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": stage, "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 0}})
    state = build_data_parallel_state(config, model, [params], None)
    optimizer = torch.optim.Adam(state.optimizer_groups([{"params": params, "lr": 0.01}]))
    names = {id(p): name for name, p in model.named_parameters()}
    return model, state, optimizer, names


def _step(model, state, optimizer) -> None:
    """One optimizer step as the engine takes it, through the protocol's training members."""
    state.begin_micro_step(True)
    model(torch.randn(4, 7, generator=torch.Generator().manual_seed(dist.get_rank()))).square().sum().backward()
    state.after_backward(True)
    state.reduce_gradients()
    assert state.grad_norm() > 0
    state.attach_grads()
    optimizer.step()
    state.detach_grads()
    state.update_model()
    state.start_window()


def _export(model, state, optimizer, names):
    """Whole per-parameter states, through the state's own file contents and its format's exporter."""
    mine = state.state_dict(optimizer, names)
    saved = [None] * dist.get_world_size()
    dist.all_gather_object(saved, mine)
    if not state.state_partitioned:
        saved = saved[:1]
    with state.gathered(list(model.parameters())):
        module = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return export_parameter_states(saved, module, state.state_partitioned), module


def _check_kind(state, stage: int) -> None:
    assert isinstance(state, DataParallelState) and isinstance(state, KINDS[stage]), type(state)
    assert state.params_partitioned == (stage == 3) and state.state_partitioned == (stage > 0)


def _assert_same(got, want, where) -> None:
    for name, weight in want.weights.items():
        assert torch.equal(got.weights[name], weight), (where, name)
        for key, value in want.optimizer[name].items():
            assert torch.equal(torch.as_tensor(got.optimizer[name][key]), torch.as_tensor(value)), (where, name, key)


def _recut_around_the_stages() -> list[str]:
    """Step at stage 0; then 0 -> 1 -> 2 -> 3 -> 0: each state exports its own file contents, the
    next stage's fresh state imports them (load_parameter_states) and must export the same again."""
    model, state, optimizer, names = _build(0, 0)
    _check_kind(state, 0)
    _step(model, state, optimizer)
    exported, module = _export(model, state, optimizer, names)
    assert set(exported.weights) == set(names.values())
    for name, weight in exported.weights.items():
        assert torch.equal(weight, module[name].float()), name
        assert exported.optimizer[name]["exp_avg"].shape == weight.shape, name
    checked = []
    for source, target in ((0, 1), (1, 2), (2, 3), (3, 0)):
        model, state, optimizer, names = _build(target, 1)
        _check_kind(state, target)
        shapes = state.parameter_shapes()  # stage 3: the parameters are empty tensors here
        by_id = {id(p): names[id(p)] for p in model.parameters()}
        assert all(tuple(shapes[i]) == tuple(exported.weights[n].shape) for i, n in by_id.items())
        state.load_parameter_states(optimizer, {i: exported.weights[n] for i, n in by_id.items()},
                                    {i: exported.optimizer[n] for i, n in by_id.items()}, exported.param_groups)
        again, module = _export(model, state, optimizer, names)
        _assert_same(again, exported, (source, target))
        assert all(torch.equal(module[n].float(), w) for n, w in exported.weights.items())  # the model too
        _step(model, state, optimizer)  # and it trains on
        checked.append(f"{source}->{target}")
    return checked


def test_every_state_implements_the_protocol_and_recuts_to_the_next(pools):
    assert pools(2).run(_recut_around_the_stages)[0] == ["0->1", "1->2", "2->3", "3->0"]


def test_checkpoint_code_neither_branches_on_the_stage_nor_reads_zero_internals():
    stage_branch = re.compile(r"\.stage\s*(==|!=|>|<|in\b)|zero_stage\"?\]?\s*(==|!=|>|<)"
                              r"|\b\d\s+(not\s+)?in\s*\(.*zero_stage")
    internals = re.compile(r"\.dp\.(master|parts|layout|grads|units)\b|\bpart\.(masters|layout)\b")
    zero_import = re.compile(r"^\s*(from megazero\.zero(?!\.protocol\b)|import megazero\.zero(?!\.protocol\b))",
                             re.MULTILINE)
    found = []
    for path in sorted(CHECKPOINT.glob("*.py")):
        text = path.read_text()
        for pattern in (stage_branch, internals, zero_import):
            found += [f"{path.name}: {m.group(0)!r}" for m in pattern.finditer(text)]
    assert found == [], found


def _state_probes(text: str, wrapper: bool) -> list[str]:
    """Where `text` discovers a state's capabilities instead of asking the protocol: getattr/hasattr
    on a state or its parts, isinstance on a concrete state, a branch on a state's stage (metadata
    only); in a wrapper, any branch on a stage number."""
    patterns = [r"\b(getattr|hasattr)\(\s*(self\.)?(dp|dp_state|inner|state|part|shard|s)\b",
                r"isinstance\([^)]*\b(ReplicatedState|PartitionedState|ShardedState|OffloadedState|"
                r"ExpertParallelState|_Shard|_GroupPartition)\b",
                r"\b(dp|dp_state|inner|state)\.stage\s*(==|!=|>=|<=|<|>|in\b)"]
    if wrapper:
        patterns.append(r"\bstage\s*(==|!=|>=|<=|<|>|in\b)")
    return [m.group(0) for pattern in patterns for m in re.finditer(pattern, text)]


def test_wrappers_and_the_engine_ask_the_protocol_not_the_state():
    found = {name: _state_probes((MEGAZERO / name).read_text(), name in WRAPPERS) for name in WRAPPERS + ENGINE}
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_the_probe_check_sees_the_probes_it_forbids():
    assert _state_probes('x = any(getattr(part, "swap", None) for part in inner.parts)', True) == ["getattr(part"]
    assert _state_probes("ok = isinstance(inner, (PartitionedState, ShardedState)) and inner.stage in (2, 3)",
                         True) == ["isinstance(inner, (PartitionedState, ShardedState", "inner.stage in", "stage in"]
    assert _state_probes("if hasattr(part, 'master_flat'):", False) == ["hasattr(part"]
