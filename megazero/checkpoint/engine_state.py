"""What an engine checkpoint holds, and how it is written and read back.

Layout of save_dir/tag/ (DeepSpeed-like names):
  mp_rank_00_model_states.pt   module state dict, counters, LR schedule, loss scaler, client state
  mp_rank_00_optim_states.pt   ZeRO stage 0: optimizer state dict and the fp32 master weights
  zero_pp_rank_{D}_mp_rank_00_optim_states.pt   ZeRO stages 1/2: data-parallel rank D's master and
                               optimizer partitions and their layout (re-cut on load for any DP size)
  rng_state_rank{R}.pt         each rank's torch / python / numpy RNG states
Resuming restores all of it, and the engine's data loader position, so a resumed run continues
bit for bit like an uninterrupted one.
"""

from __future__ import annotations

import os
import random
import warnings

import numpy as np
import torch

from megazero.checkpoint.io import (
    CheckpointError,
    atomic_checkpoint_dir,
    check_plain,
    check_tag,
    load_file,
    read_latest,
    save_file,
)
from megazero.checkpoint.zero_state import ZERO_FILE, load_zero_state, zero_state

MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIM_FILE = "mp_rank_00_optim_states.pt"
FORMAT_VERSION = 1


def rng_file(rank: int) -> str:
    """Name of the RNG-state file of global rank `rank`."""
    return f"rng_state_rank{rank}.pt"


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


def save_engine_checkpoint(engine, save_dir, tag: str | None, client_state: dict) -> str:
    """Collective: every rank of the engine's world calls it. Returns the published directory."""
    save_dir = os.fspath(save_dir)
    tag = check_tag(tag or f"global_step{engine.global_steps}")
    check_plain(client_state)
    names = {id(p): name for name, p in engine.module.named_parameters()}
    with atomic_checkpoint_dir(save_dir, tag) as tmp:
        if engine.global_rank == 0:
            save_file(_model_state(engine, client_state), os.path.join(tmp, MODEL_FILE))
        if engine.dp.stage == 0 and engine.global_rank == 0:
            master = engine.dp.master
            save_file({"optimizer": engine.optimizer.state_dict(),
                       "param_names": [names[id(p)] for p in master.model_params],
                       "master_params": [p.detach() for p in master.params] if master.separate else None},
                      os.path.join(tmp, OPTIM_FILE))
        elif engine.dp.stage > 0:
            save_file(zero_state(engine, names), os.path.join(tmp, ZERO_FILE.format(dp=engine.dp_rank)))
        save_file(capture_rng_state(), os.path.join(tmp, rng_file(engine.global_rank)))
    return os.path.join(save_dir, tag)


def _model_state(engine, client_state: dict) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "module": _module_state(engine),
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "dp_world_size": engine.dp_world_size,
        "zero_stage": engine.dp.stage,
        "train_batch_size": engine.train_batch_size(),
        "client_state": client_state,
    }


def _module_state(engine) -> dict:
    """The module's state dict; under ZeRO-3 without the (partitioned) parameters, which live in the
    per-rank ZeRO files, so that no rank has to hold the whole model to save it."""
    state = engine.module.state_dict()
    if engine.dp.stage == 3:
        params = {name for name, _ in engine.module.named_parameters()}
        state = {k: v for k, v in state.items() if k not in params}
    return state


def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    """The tag to load: the given one, else the one named by `latest` (None if there is none)."""
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            return None
    check_tag(tag)
    path = os.path.join(load_dir, tag)
    old = os.path.join(load_dir, f".{tag}.old")
    if not os.path.isdir(path) and os.path.isdir(old):
        os.replace(old, path)  # a save of the same tag was killed between its two renames
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory not found: {path}")
    return tag


def load_engine_checkpoint(engine, load_dir, tag: str | None, load_optimizer_states: bool,
                           load_lr_scheduler_states: bool):
    """Restore an engine from load_dir/tag; returns (path, client_state) or (None, None)."""
    load_dir = os.fspath(load_dir)
    tag = resolve_tag(load_dir, tag)
    if tag is None:
        warnings.warn(f"no 'latest' file in {load_dir}: nothing to load, starting from scratch", stacklevel=3)
        return None, None
    path = os.path.join(load_dir, tag)
    state = load_file(os.path.join(path, MODEL_FILE))
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}/{MODEL_FILE}: format_version {state.get('format_version')!r}, "
                              f"expected {FORMAT_VERSION}")
    engine.module.load_state_dict(state["module"], strict=state["zero_stage"] != 3 and engine.dp.stage != 3)
    if load_optimizer_states:
        if state["zero_stage"] != engine.dp.stage:
            raise CheckpointError(f"{path} was saved with ZeRO stage {state['zero_stage']}, the engine runs stage "
                                  f"{engine.dp.stage}; load with load_optimizer_states=False to take the weights only")
        if engine.dp.stage == 0:
            _load_replicated_optimizer(engine, path)
        else:
            load_zero_state(engine, path, {id(p): name for name, p in engine.module.named_parameters()})
    else:
        engine.dp.reset_masters()
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.loss_scaler.load_state_dict(state["loss_scaler"])
    engine.global_steps = state["global_steps"]
    engine.global_samples = state["global_samples"]
    engine.micro_steps = state["micro_steps"]
    engine.skipped_steps = state["skipped_steps"]
    _restore_data_position(engine, state)
    rng_path = os.path.join(path, rng_file(engine.global_rank))
    if os.path.isfile(rng_path):
        restore_rng_state(load_file(rng_path))
    else:
        warnings.warn(f"{rng_path} not found (saved with another world size?): RNG states not restored",
                      stacklevel=3)
    return path, state["client_state"]


def _load_replicated_optimizer(engine, path: str) -> None:
    optim = load_file(os.path.join(path, OPTIM_FILE))
    engine.optimizer.load_state_dict(optim["optimizer"])
    master = engine.dp.master
    if master.separate:
        with torch.no_grad():
            for param, saved in zip(master.params, optim["master_params"]):
                param.copy_(saved)
        master.copy_to_model()


def _restore_data_position(engine, state: dict) -> None:
    if engine.training_dataloader is not None:
        engine.training_dataloader.set_consumed_samples(state["global_samples"])
