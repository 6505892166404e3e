"""What an engine checkpoint holds, and how it is written and read back.

Files of save_dir/tag/ (names in checkpoint.files), per (tensor rank TP, pipeline stage PP):
  mp_rank_{TP}[_{PP}]_model_states.pt   module state dict under global parameter names, the
                               layout (TP, PP, DP sizes, ZeRO stage), each parameter's partition
                               dimension, counters, LR schedule, loss scaler, client state
  mp_rank_{TP}[_{PP}]_optim_states.pt   a replicated data-parallel state (ZeRO 0): its state_dict()
                               (optimizer state dict and fp32 master weights), from DP rank 0
  zero_pp_rank_{D}_mp_rank_{TP}[_{PP}]_optim_states.pt   a partitioned one (ZeRO 1-3): data-parallel
                               rank D's state_dict() (master and optimizer partitions, their layout)
  rng_state_rank{R}.pt         each rank's torch / python / numpy RNG states (and the TP tracker's)
  optim_rank_state_rank{R}.pt  an optimizer's state of its own on each rank (RankLocalState: the
                               1-bit optimizers' compression errors), restored at the same layout
Resuming at the same layout restores all of it, and the engine's data loader position, so a
resumed run continues bit for bit like an uninterrupted one. At any other layout (TP, PP, DP or
ZeRO stage changed) the states are reassembled per parameter and cut again (checkpoint.universal);
the per-rank generator states are then not restored. Dropout does not depend on them: training
forwards draw from streams keyed by the seed (saved in the model file, restored at every layout),
the step and the micro-batch's coordinates (tensor_parallel.random.MicroBatchStreams).
What a data-parallel state writes and how it is re-cut is its own (megazero.zero.protocol): this
module knows the ZeRO stage only as metadata (written, and compared for "same layout").
"""

from __future__ import annotations

import os
import random
import warnings

import numpy as np
import torch
import torch.distributed as dist

from megazero.checkpoint.files import (
    FORMAT_VERSION,
    LATEST_FILE,
    MODEL_FILES,
    model_file,
    model_files_in,
    optim_file,
    rank_state_file,
    replaced_dir,
    rng_file,
    zero_file,
)
from megazero.checkpoint.io import (
    CheckpointError,
    agree_on_tag,
    atomic_checkpoint_dir,
    check_format_version,
    check_plain,
    check_tag,
    load_file,
    read_latest,
    save_file,
)
from megazero.checkpoint.manifest import check_files, complete_tags, directory_problems, read_manifest
from megazero.checkpoint.universal import apply_parameter_states, read_parameter_states, saved_layout
from megazero.model_contract import global_name_of, model_config_dict
from megazero.optim.protocol import RankLocalState
from megazero.tensor_parallel.random import get_rng_tracker
from megazero.tensor_parallel.utils import partition_of

MODEL_FILE = model_file()  # the single-process (TP = PP = 1) name


def capture_rng_state() -> dict:
    """This process's RNG states as tensors and plain values."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *[v for v in np_state[2:]]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    state["tensor_parallel"] = get_rng_tracker().get_states()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of capture_rng_state()."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy(), int(pos), int(has_gauss), float(cached)))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "tensor_parallel" in state:
        get_rng_tracker().set_states(state["tensor_parallel"])


def global_names(module: torch.nn.Module) -> dict[int, str]:
    """id(param) -> its name in the whole model (a pipeline stage's module maps its local layer
    numbers through the model contract's `global_parameter_name`, when it has one)."""
    rename = global_name_of(module)
    return {id(p): rename(name) for name, p in module.named_parameters()}


def layout_of(engine) -> dict:
    """The engine's layout: tensor/pipeline/data-parallel sizes, ZeRO stage, this rank's TP/PP ranks."""
    grid = engine.grid
    return {"tp": grid.tensor_model_parallel_size if grid else 1, "pp": grid.pipeline_model_parallel_size if grid
            else 1, "dp": engine.dp_world_size, "zero_stage": engine.dp.stage,
            "tp_rank": grid.tp_rank if grid else 0, "pp_rank": grid.pp_rank if grid else 0}


def _files(engine) -> tuple[str, str]:
    """(model file, this rank's data-parallel state file): a partitioned state's own per rank, a
    replicated one's shared by the data-parallel ranks."""
    layout = layout_of(engine)
    where = (layout["tp_rank"], layout["pp_rank"], layout["pp"])
    state = zero_file(engine.dp_rank, *where) if engine.dp.state_partitioned else optim_file(*where)
    return model_file(*where), state


def save_engine_checkpoint(engine, save_dir, tag, client_state: dict) -> str:
    """Collective: every rank of the engine's world calls it. Returns the published directory.

    The tag is str(tag) (default 'global_step{N}'), and rank 0's on every rank (checkpoint.tag_validation
    says whether ranks with another tag are named in a warning or an error)."""
    save_dir = os.fspath(save_dir)
    tag = agree_on_tag(tag, engine.config.checkpoint.tag_validation)
    tag = check_tag(f"global_step{engine.global_steps}" if tag is None else tag)
    check_plain(client_state)
    names = global_names(engine.module)
    model_name, state_name = _files(engine)
    layout = {k: v for k, v in layout_of(engine).items() if not k.endswith("_rank")}
    layout.update(world_size=_world_size(), format_version=FORMAT_VERSION)
    with atomic_checkpoint_dir(save_dir, tag, layout=layout, keep_last=engine.config.checkpoint.keep_last) as tmp:
        if engine.dp_rank == 0:  # one writer per (tensor rank, pipeline stage)
            save_file(_model_state(engine, client_state, names), os.path.join(tmp, model_name))
        if engine.dp.state_partitioned or engine.dp_rank == 0:  # a replicated state: one writer
            save_file(engine.dp.state_dict(engine.optimizer, names), os.path.join(tmp, state_name))
        save_file(capture_rng_state(), os.path.join(tmp, rng_file(engine.global_rank)))
        if isinstance(engine.optimizer, RankLocalState):
            save_file(engine.optimizer.rank_state_dict(), os.path.join(tmp, rank_state_file(engine.global_rank)))
    return os.path.join(save_dir, tag)


def _model_state(engine, client_state: dict, names: dict[int, str]) -> dict:
    params = dict(engine.module.named_parameters())
    return {
        "format_version": FORMAT_VERSION,
        "module": _module_state(engine),
        "layout": layout_of(engine),
        "param_meta": {names[id(p)]: list(partition_of(p)) for p in params.values()},
        "model_config": model_config_dict(engine.module),
        **engine.steps.state_dict(engine.gradient_accumulation_steps()),  # the step counters (StepState)
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "dp_world_size": engine.dp_world_size,
        "zero_stage": engine.dp.stage,
        "train_batch_size": engine.train_batch_size(),
        "client_state": client_state,
        "rng_seed": engine.rng_streams.seed,
    }


def _module_state(engine) -> dict:
    """The module's state dict under global names; without the parameters when the data-parallel
    state partitions them (ZeRO-3): they live in the per-rank state files, so that no rank has to
    hold the whole model to save it."""
    rename = global_name_of(engine.module)
    state = engine.module.state_dict()
    if engine.dp.params_partitioned:
        params = {name for name, _ in engine.module.named_parameters()}
        state = {k: v for k, v in state.items() if k not in params}
    return {rename(k): v for k, v in state.items()}


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _restore_replaced(load_dir: str, tag: str) -> None:
    """A save of the same tag killed between its two renames left the complete previous directory
    under its replaced name: put it back (any rank may get there first)."""
    path, old = os.path.join(load_dir, tag), replaced_dir(load_dir, tag)
    if not os.path.isdir(path) and os.path.isdir(old):
        try:
            os.replace(old, path)
        except FileNotFoundError:  # another rank restored it
            pass


def _latest_problem(load_dir: str) -> tuple[str | None, str | None]:
    """(the tag `latest` names, why it cannot be loaded or None)."""
    try:
        tag = read_latest(load_dir)
    except CheckpointError:
        return None, "does not hold a tag (not UTF-8 text)"
    if tag is None:
        return None, "is empty"
    try:
        tag = check_tag(tag)
    except CheckpointError as e:
        return None, f"does not hold a tag ({e})"
    _restore_replaced(load_dir, tag)
    problems = directory_problems(os.path.join(load_dir, tag))
    if problems:
        return tag, f"names {tag!r}, which is not a complete checkpoint: {'; '.join(problems[:3])}"
    return tag, None


def resolve_tag(load_dir: str, tag, fallback: bool = False) -> str | None:
    """The tag to load: str(tag), else the one named by `latest` (None if there is none). When `latest`
    is garbage or names a missing or incomplete directory, CheckpointError names the file and the
    previous complete tag; with `fallback`, that tag is returned instead, with a warning."""
    if tag is None:
        if not os.path.isfile(os.path.join(load_dir, LATEST_FILE)):
            return None
        named, problem = _latest_problem(load_dir)
        if problem is None:
            return named
        latest = os.path.join(load_dir, LATEST_FILE)
        previous = complete_tags(load_dir, exclude=named)
        if not previous:
            raise CheckpointError(f"{latest} {problem}; {load_dir} holds no complete checkpoint to fall back to")
        if not fallback:
            raise CheckpointError(f"{latest} {problem}; the previous complete tag is {previous[-1]!r} (load it by "
                                  f"tag, or with load_checkpoint(..., fallback=True); recipes: --load-fallback)")
        warnings.warn(f"{latest} {problem}; loading the previous complete tag {previous[-1]!r} instead", stacklevel=3)
        return previous[-1]
    tag = check_tag(tag)
    _restore_replaced(load_dir, tag)
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory not found: {path}")
    return tag


def verify_checkpoint_dir(path: str, checksums: bool) -> None:
    """Collective: raise CheckpointError on every rank, naming the bad files, unless every file the
    manifest of `path` lists has its size (and, with `checksums`, its checksum; the ranks share the
    reading). A directory without a manifest (written before manifests) is not checked."""
    try:
        manifest = read_manifest(path)
        problems = []
    except ValueError as e:
        manifest, problems = None, [str(e)]
    if manifest is not None:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        mine = set(sorted(manifest["files"])[rank::world])
        problems = check_files(path, manifest, checksums, mine)
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, problems)
        problems = list(dict.fromkeys(p for rank_problems in everyone for p in rank_problems))
    if problems:
        more = f" and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise CheckpointError(f"checkpoint {path} is not whole: {'; '.join(problems[:5])}{more}")


def _read_model_state(path: str, name: str) -> dict:
    state = load_file(os.path.join(path, name))
    check_format_version(state, f"{path}/{name}")
    return state


def load_engine_checkpoint(engine, load_dir, tag, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                           load_module_strict: bool = True, load_module_only: bool = False, fallback: bool = False):
    """Restore an engine from load_dir/tag (rank 0's tag on every rank, as when saving); returns
    (path, client_state) or (None, None). load_module_only: the module's weights and buffers only;
    load_module_strict: the checkpoint's module keys must match the model's (DeepSpeed's meanings).
    The files are checked against the manifest first (sizes; checksums too with checkpoint.verify);
    fallback: a corrupt `latest` loads the previous complete tag, with a warning."""
    load_dir = os.fspath(load_dir)
    asked = agree_on_tag(tag, engine.config.checkpoint.tag_validation)
    tag = resolve_tag(load_dir, asked, fallback)
    if tag is None:
        if not dist.is_initialized() or dist.get_rank() == 0:  # one notice per run, not one per rank
            warnings.warn(f"no 'latest' file in {load_dir}: nothing to load, starting from scratch", stacklevel=3)
        return None, None
    path = os.path.join(load_dir, tag)
    try:
        verify_checkpoint_dir(path, engine.config.checkpoint.verify)
    except CheckpointError as e:
        # a checksum `latest`'s own size check cannot see: the same way back as for a corrupt `latest`
        previous = complete_tags(load_dir, exclude=tag) if asked is None else []
        if not previous:
            raise
        if not fallback:
            raise CheckpointError(f"{e} (the tag `latest` names); the previous complete tag is {previous[-1]!r} "
                                  f"(load it by tag, or with "
                                  f"load_checkpoint(..., fallback=True); recipes: --load-fallback)") from None
        warnings.warn(f"{e} (the tag `latest` names); loading the previous complete tag {previous[-1]!r} instead",
                      stacklevel=3)
        tag = previous[-1]
        path = os.path.join(load_dir, tag)
        verify_checkpoint_dir(path, engine.config.checkpoint.verify)
    model_name, state_name = _files(engine)
    mine = layout_of(engine)
    state = _read_model_state(path, model_name if os.path.isfile(os.path.join(path, model_name))
                              else _any_model_file(path))
    if state.get("weights_only"):  # imported weights (scripts/import_hf.py): the rest starts afresh
        apply_parameter_states(engine, read_parameter_states(path), False, global_names(engine.module))
        return path, state["client_state"]
    if load_module_only:
        _load_module_only(engine, path, state, load_module_strict)
        return path, state["client_state"]
    saved = saved_layout(state)
    # the same ranks in the same places: each rank's own RNG file is its own
    same_layout = (all(saved[k] == mine[k] for k in ("tp", "pp", "dp", "zero_stage")) and not state.get("converted")
                   and _same_stage_layers(engine, state))
    # weights only: always per parameter (the ZeRO-3 module file holds no parameters)
    same = same_layout and load_optimizer_states
    names = global_names(engine.module)
    if same:
        own = load_file(os.path.join(path, state_name))
        same = engine.dp.same_layout(own, names)
    if same:
        _load_same_layout(engine, path, state, os.path.join(path, state_name), own, load_module_strict)
    else:
        apply_parameter_states(engine, read_parameter_states(path), load_optimizer_states, names)
        engine.module.load_state_dict(_local_buffers(engine, state), strict=False)
    _restore_engine_state(engine, state, load_lr_scheduler_states, same_layout)
    _restore_rank_state(engine, path, same_layout, load_optimizer_states)
    if state.get("rng_seed") is not None:  # the dropout streams' seed: layout-independent
        engine.rng_streams.seed = int(state["rng_seed"])
    rng_path = os.path.join(path, rng_file(engine.global_rank))
    if same_layout and os.path.isfile(rng_path):
        restore_rng_state(load_file(rng_path))
    else:
        why = "saved at another layout" if not same_layout else f"no {rng_file(engine.global_rank)}"
        warnings.warn(f"{path}: {why}: this rank's torch/python/numpy generator states not restored (dropout "
                      f"streams are keyed by seed, step and micro-batch, so they continue)", stacklevel=3)
    return path, state["client_state"]


def _restore_rank_state(engine, path: str, same_layout: bool, load_optimizer_states: bool) -> None:
    """An optimizer's per-rank state (RankLocalState): this rank's file at the same layout; otherwise
    (or without the optimizer states) it starts afresh, with a warning."""
    optimizer = engine.optimizer
    if not isinstance(optimizer, RankLocalState):
        return
    own = os.path.join(path, rank_state_file(engine.global_rank))
    if same_layout and load_optimizer_states and os.path.isfile(own):
        optimizer.load_rank_state_dict(load_file(own))
        engine.dp.update_model()  # it may hold this rank's own weights (0/1 Adam between synchronisations)
        return
    optimizer.load_rank_state_dict(None)
    why = ("optimizer states not loaded" if not load_optimizer_states else "saved at another layout"
           if not same_layout else f"no {rank_state_file(engine.global_rank)}")
    if engine.global_rank == 0:
        warnings.warn(f"{path}: {why}: {type(optimizer).__name__}'s per-rank state (compression errors) starts "
                      f"afresh", stacklevel=4)


def _any_model_file(path: str) -> str:
    found = model_files_in(path)
    if not found:
        raise CheckpointError(f"{path}: no {MODEL_FILES} file")
    return os.path.basename(found[0])


def _same_stage_layers(engine, state: dict) -> bool:
    """Whether the model file holds this rank's layers: at the same PP size a stage split by another
    partition method or into other model chunks holds others (its file then loads per parameter).
    ZeRO-3's module file holds no parameters: its partitioning's own same_layout compares them."""
    if engine.dp.params_partitioned:
        return True
    rename = global_name_of(engine.module)
    mine = {rename(k) for k in engine.module.state_dict()}
    params = {rename(name) for name, _ in engine.module.named_parameters()}
    saved = set(state["module"])
    return saved <= mine and params <= saved


def _local_buffers(engine, state: dict) -> dict:
    """The module's non-parameter state (buffers) from a model file, under local names."""
    rename = global_name_of(engine.module)
    params = {name for name, _ in engine.module.named_parameters()}
    local = {rename(k): k for k in engine.module.state_dict() if k not in params}
    return {local[k]: v for k, v in state["module"].items() if k in local}


def _load_module_state(engine, path: str, state: dict, strict: bool) -> None:
    """The model file's module state into the engine's module (global names mapped to local ones;
    keys the model lacks are passed on as they are, for strict loading to name them)."""
    rename = global_name_of(engine.module)
    local = {rename(k): k for k in engine.module.state_dict()}
    try:
        engine.module.load_state_dict({local.get(k, k): v for k, v in state["module"].items()}, strict=strict)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: {e} (load_checkpoint(..., load_module_strict=False) skips such keys)") from e


def _load_module_only(engine, path: str, state: dict, strict: bool) -> None:
    """Weights and buffers only: optimizer, schedule, counters, loss scale and RNG keep their state.
    At the saved tensor/pipeline layout, when the model file holds the parameters and the engine's
    state does not partition them (no ZeRO-3 on either side), the model file holds this rank's whole
    module; otherwise the weights are reassembled per parameter (strict only)."""
    saved, mine = saved_layout(state), layout_of(engine)
    if (saved["tp"], saved["pp"]) == (mine["tp"], mine["pp"]) and _holds_parameters(engine, state) \
            and not engine.dp.params_partitioned and not state.get("converted"):
        _load_module_state(engine, path, state, strict)
        engine.dp.reset_masters()
        return
    if not strict:
        raise CheckpointError(f"{path}: load_module_strict=False needs the saved tensor/pipeline layout and no ZeRO-3 "
                              f"(saved {saved}, engine {mine}): the weights are matched per parameter here")
    apply_parameter_states(engine, read_parameter_states(path), False, global_names(engine.module))
    engine.module.load_state_dict(_local_buffers(engine, state), strict=False)


def module_weights(engine) -> dict[str, torch.Tensor] | None:
    """Collective: the whole module's state dict in its own dtype (copies), on global rank 0; None on
    the other ranks. Under ZeRO-3 each layer (an element of an nn.ModuleList, as ZeRO-3 cuts units)
    is gathered in turn, so the other ranks never hold more than one layer whole."""
    module = engine.module
    is_writer = engine.global_rank == 0
    layers = [list(child.parameters()) for m in module.modules() if isinstance(m, torch.nn.ModuleList) for child in m]
    in_layers = {id(p) for layer in layers for p in layer}
    groups = [[p for p in module.parameters() if id(p) not in in_layers]] + layers
    copies: dict[int, torch.Tensor] = {}
    for params in groups:
        with engine.dp.gathered(params):  # a no-op for parameters the state does not partition
            if is_writer:
                copies.update({id(p): p.detach().clone() for p in params})
    if not is_writer:
        return None
    # tied names share one copy, so torch.save keeps them tied
    return {name: copies[id(t)] if id(t) in copies else t.detach().clone()
            for name, t in module.state_dict(keep_vars=True).items()}


def _holds_parameters(engine, state: dict) -> bool:
    """True when a model file's module state holds the parameters (not those of a state that
    partitions them, ZeRO-3, which saves them in its own files)."""
    names = state.get("param_meta") or global_names(engine.module).values()
    return any(name in state["module"] for name in names)


def _load_same_layout(engine, path: str, state: dict, state_path: str, own: dict, strict: bool) -> None:
    """The module from the model file, then the data-parallel state from its own file `own`."""
    _load_module_state(engine, path, state, strict and not engine.dp.params_partitioned)
    try:
        engine.dp.load_state_dict(own, engine.optimizer)
    except ValueError as e:
        raise CheckpointError(f"{state_path}: {e}") from e


def _restore_engine_state(engine, state: dict, load_lr_scheduler_states: bool, same_layout: bool) -> None:
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.loss_scaler.load_state_dict(state["loss_scaler"])
    # another layout may accumulate another number of micro-batches per step: it resumes at a step's start
    engine.steps.load_state_dict(state, engine.gradient_accumulation_steps(), same_layout)
    if engine.training_dataloader is not None:
        engine.training_dataloader.set_consumed_samples(state["global_samples"])

