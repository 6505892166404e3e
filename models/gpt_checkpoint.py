"""A GPT (or BERT) from, or a GPT to, a megazero checkpoint of any layout, for the tools that run
one process: generation, evaluation, Hugging Face export and import."""

from __future__ import annotations

import glob
import os

import torch

from megazero.checkpoint.consolidate import consolidate_fp32_state_dict
from megazero.checkpoint.convert import StageParameter, write_converted
from megazero.checkpoint.engine_state import resolve_tag
from megazero.checkpoint.io import CheckpointError, load_file
from megazero.checkpoint.universal import ParameterStates
from megazero.tensor_parallel.utils import partition_of
from models.gpt import GPT, GPTConfig


def saved_model_config(checkpoint_dir: str, tag: str | None = None, config_class=GPTConfig):
    """The model config a checkpoint was trained with (GPTConfig, or config_class, e.g.
    BertConfig), as the single-process (TP = 1) model with the same (padded) vocabulary."""
    tag = resolve_tag(checkpoint_dir, tag)
    if tag is None:
        raise CheckpointError(f"{checkpoint_dir}: no 'latest' file and no tag given")
    files = sorted(glob.glob(os.path.join(checkpoint_dir, tag, "mp_rank_*_model_states.pt")))
    if not files:
        raise CheckpointError(f"{checkpoint_dir}/{tag}: no mp_rank_*_model_states.pt file")
    saved = load_file(files[0]).get("model_config")
    if saved is None:
        raise CheckpointError(f"{files[0]}: no model_config (not saved from a models/ model)")
    return config_class(**saved).whole()


def is_bert_checkpoint(checkpoint_dir: str, tag: str | None = None) -> bool:
    """True when the checkpoint holds a models.bert.Bert (its config has a binary head)."""
    tag = resolve_tag(checkpoint_dir, tag)
    files = sorted(glob.glob(os.path.join(checkpoint_dir, tag or "", "mp_rank_*_model_states.pt")))
    return bool(files) and "binary_head" in (load_file(files[0]).get("model_config") or {})


def load_model(checkpoint_dir: str, tag: str | None = None, model_class=GPT, config_class=GPTConfig):
    """The whole model from any checkpoint layout (TP shards joined, stages merged, fp32 masters)."""
    config = saved_model_config(checkpoint_dir, tag, config_class)
    with torch.device("meta"):
        model = model_class(config)
    model.load_state_dict(consolidate_fp32_state_dict(checkpoint_dir, tag), strict=True, assign=True)
    return model.eval()


def write_gpt_checkpoint(config: GPTConfig, state: dict[str, torch.Tensor], save_dir: str,
                         tag: str = "global_step0") -> str:
    """A weights-only megazero checkpoint (TP = PP = 1) that engines of any layout load, starting
    their optimizer afresh (e.g. to continue training an imported model)."""
    with torch.device("meta"):
        model = GPT(config)
    names = [name for name, _ in model.named_parameters()]
    missing = sorted(set(names) - set(state))
    if missing:
        raise CheckpointError(f"state dict lacks {missing[:5]}")
    weights = {name: state[name].float().contiguous() for name in names}
    engine = {"format_version": 2, "global_steps": 0, "global_samples": 0, "micro_steps": 0, "skipped_steps": 0,
              "lr_scheduler": None, "loss_scaler": None, "train_batch_size": None, "client_state": {},
              "weights_only": True}
    states = ParameterStates(weights=weights, optimizer={n: {} for n in names}, group_of={n: 0 for n in names},
                             param_groups=[{}], module=dict(weights), engine=engine)
    stage = [StageParameter(n, *partition_of(p)) for n, p in model.named_parameters()]
    return write_converted(states, save_dir, tag, [stage], 1, config.to_dict())
