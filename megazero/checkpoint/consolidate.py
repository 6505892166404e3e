"""One full fp32 state dict from any checkpoint, whatever its ZeRO stage and data-parallel size."""

from __future__ import annotations

import os

import torch

from megazero.checkpoint.engine_state import MODEL_FILE, OPTIM_FILE, resolve_tag
from megazero.checkpoint.io import CheckpointError, load_file
from megazero.checkpoint.zero_state import per_parameter_states, read_zero_files


def consolidate_fp32_state_dict(checkpoint_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict with every trainable parameter as its fp32 master weight (padding stripped).

    Parameters come from the optimizer files (so 16-bit training yields the fp32 masters, not the
    rounded copies); buffers come from the model file as saved.
    """
    tag = resolve_tag(checkpoint_dir, tag)
    if tag is None:
        raise CheckpointError(f"{checkpoint_dir}: no 'latest' file and no tag given")
    path = os.path.join(checkpoint_dir, tag)
    state = load_file(os.path.join(path, MODEL_FILE))
    masters: dict[str, torch.Tensor] = {}
    if state["zero_stage"] == 0:
        optim = load_file(os.path.join(path, OPTIM_FILE))
        if optim["master_params"] is not None:
            masters = dict(zip(optim["param_names"], optim["master_params"]))
    else:
        for group in per_parameter_states(read_zero_files(path)):
            masters.update(group["master"])
    out = {}
    for name, tensor in state["module"].items():
        if name in masters:
            out[name] = masters.pop(name).float().reshape(tensor.shape).contiguous()
        else:
            out[name] = tensor.float() if tensor.is_floating_point() else tensor
    out.update({name: t.float().contiguous() for name, t in masters.items()})  # ZeRO-3: parameters only here
    return out


def save_consolidated(state_dict: dict[str, torch.Tensor], output: str) -> None:
    """Write to `output`: safetensors when it ends in .safetensors, else a weights-only torch file."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = output + ".tmp"
    if output.endswith(".safetensors"):
        from safetensors.torch import save_file as save_safetensors

        save_safetensors({k: v.contiguous() for k, v in state_dict.items()}, tmp)
    else:
        torch.save(state_dict, tmp)
    os.replace(tmp, output)
