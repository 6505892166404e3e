"""A whole model from, or a model to, a checkpoint of any layout, for the tools that run one
process: generation, evaluation, Hugging Face export and import.

The library knows no model: callers pass the model class and its config class (models.gpt's
GPT / GPTConfig, models.bert's Bert / BertConfig, or their own). A model class is built as
`model_class(config)` (the whole model, one process); a config class as `config_class(**saved)`
from the dict the checkpoint saved, and has `whole()` (the same model at TP = 1) and `to_dict()`.
"""

from __future__ import annotations

import os

import torch

from megazero.checkpoint.consolidate import consolidate_fp32_state_dict
from megazero.checkpoint.convert import StageParameter, write_converted
from megazero.checkpoint.engine_state import resolve_tag
from megazero.checkpoint.files import FORMAT_VERSION, MODEL_FILES, model_files_in
from megazero.checkpoint.io import CheckpointError, load_file
from megazero.checkpoint.universal import ParameterStates
from megazero.data.tokenizer import TokenizerSpec
from megazero.meta_device import skeleton
from megazero.tensor_parallel.utils import partition_of


def _first_model_file(checkpoint_dir: str, tag: str | None) -> str:
    tag = resolve_tag(checkpoint_dir, tag)
    if tag is None:
        raise CheckpointError(f"{checkpoint_dir}: no 'latest' file and no tag given")
    files = model_files_in(os.path.join(checkpoint_dir, tag))
    if not files:
        raise CheckpointError(f"{checkpoint_dir}/{tag}: no {MODEL_FILES} file")
    return files[0]


def saved_model_config_dict(checkpoint_dir: str, tag: str | None = None) -> dict | None:
    """The model config dict a checkpoint was saved with (None when its model had no config)."""
    return load_file(_first_model_file(checkpoint_dir, tag)).get("model_config")


def saved_tokenizer_spec(checkpoint_dir: str, tag: str | None = None) -> TokenizerSpec | None:
    """The tokenizer the checkpoint names (its paths; the files are not copied): that of the recipe
    run that saved it (its run config's data section), or of the Hugging Face directory it was
    imported from. None when it names none (saved outside a recipe)."""
    client = load_file(_first_model_file(checkpoint_dir, tag)).get("client_state") or {}
    data = (client.get("run_config") or {}).get("data") or {}
    if data.get("tokenizer_type") or data.get("tokenizer_model"):  # a run config without a type: sentencepiece
        return TokenizerSpec(data.get("tokenizer_type") or "sentencepiece", data.get("tokenizer_model"),
                             data.get("vocab_file"), data.get("merge_file"))
    if client.get("tokenizer"):
        return TokenizerSpec(**client["tokenizer"])
    return None


def saved_model_config(checkpoint_dir: str, tag: str | None = None, *, config_class):
    """The model config a checkpoint was trained with, as a `config_class` (e.g. GPTConfig or
    BertConfig), for the single-process (TP = 1) model with the same (padded) vocabulary."""
    path = _first_model_file(checkpoint_dir, tag)
    saved = load_file(path).get("model_config")
    if saved is None:
        raise CheckpointError(f"{path}: no model_config (saved from a model without a config), so no "
                              f"{config_class.__name__} to rebuild the model from")
    return config_class(**saved).whole()


def load_model(checkpoint_dir: str, tag: str | None = None, *, model_class, config_class) -> torch.nn.Module:
    """The whole model from any checkpoint layout (TP shards joined, stages merged, fp32 masters),
    in eval mode."""
    config = saved_model_config(checkpoint_dir, tag, config_class=config_class)
    with skeleton():
        model = model_class(config)
    model.load_state_dict(consolidate_fp32_state_dict(checkpoint_dir, tag), strict=True, assign=True)
    return model.eval()


def write_weights_checkpoint(config, state: dict[str, torch.Tensor], save_dir: str, tag: str = "global_step0", *,
                             model_class, client_state: dict | None = None) -> str:
    """A weights-only checkpoint (TP = PP = 1) of `model_class(config)` that engines of any layout
    load, starting their optimizer afresh (e.g. to continue training an imported model);
    `client_state` is saved as a training run's is (e.g. {"tokenizer": spec dict})."""
    with skeleton():
        model = model_class(config)
    names = [name for name, _ in model.named_parameters()]
    missing = sorted(set(names) - set(state))
    if missing:
        raise CheckpointError(f"state dict lacks {missing[:5]}")
    weights = {name: state[name].float().contiguous() for name in names}
    engine = {"format_version": FORMAT_VERSION, "global_steps": 0, "global_samples": 0, "micro_steps": 0,
              "skipped_steps": 0, "lr_scheduler": None, "loss_scaler": None, "train_batch_size": None,
              "client_state": client_state or {}, "weights_only": True}
    states = ParameterStates(weights=weights, optimizer={n: {} for n in names}, group_of={n: 0 for n in names},
                             param_groups=[{}], module=dict(weights), engine=engine)
    stage = [StageParameter(n, *partition_of(p)) for n, p in model.named_parameters()]
    return write_converted(states, save_dir, tag, [stage], 1, config.to_dict())
