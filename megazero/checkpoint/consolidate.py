"""One full fp32 state dict from any checkpoint, whatever its ZeRO stage and data-parallel size."""

from __future__ import annotations

import os

import torch

from megazero.checkpoint.engine_state import resolve_tag
from megazero.checkpoint.io import CheckpointError
from megazero.checkpoint.universal import read_parameter_states


def consolidate_fp32_state_dict(checkpoint_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The whole model's state dict with every trainable parameter as its fp32 master weight (padding
    stripped, tensor-parallel shards joined, pipeline stages merged, global parameter names).

    Parameters come from the optimizer files (so 16-bit training yields the fp32 masters, not the
    rounded copies); buffers come from the model files as saved.
    """
    tag = resolve_tag(checkpoint_dir, tag)
    if tag is None:
        raise CheckpointError(f"{checkpoint_dir}: no 'latest' file and no tag given")
    states = read_parameter_states(os.path.join(checkpoint_dir, tag))
    out = {}
    for name, tensor in states.module.items():
        if name in states.weights:
            out[name] = states.weights[name].float().reshape(tensor.shape).contiguous()
        else:
            out[name] = tensor.float() if tensor.is_floating_point() else tensor
    out.update({name: t.float().contiguous() for name, t in states.weights.items() if name not in out})
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
