"""Import a Hugging Face GPT-2, Llama or Mixtral (a directory with config.json and model.safetensors
or pytorch_model.bin: GPT2LMHeadModel, LlamaForCausalLM or MixtralForCausalLM: megazero's Llama
with MoE layers, models/hf_mixtral.py) as a megazero checkpoint, to continue training it at any
layout.

    python scripts/import_hf.py --hf-dir DIR --save CKPT_DIR [--tag global_step0]

The result holds the weights (optimizer state starts afresh when an engine loads it); scripts/
export_hf.py on it writes the same tensors back. When DIR holds a tokenizer (tokenizer.json,
tokenizer_config.json or tokenizer.model), the checkpoint names it (a HuggingFaceTokenizer of DIR):
scripts/generate.py, evaluate.py and export_hf.py use it when given no tokenizer flag.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from megazero.checkpoint.model_files import write_weights_checkpoint
from megazero.data import TokenizerSpec
from models import hf_gpt2, hf_llama, hf_mixtral
from models.gpt import GPT
from models.llama import Llama

FAMILIES = {"gpt2": (hf_gpt2.from_hf, GPT), "llama": (hf_llama.from_hf, Llama),  # by config.json's model_type
            "mixtral": (hf_mixtral.from_hf, Llama)}

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def read_hf_state(directory: str) -> dict[str, torch.Tensor]:
    """The state dict of a Hugging Face model directory (safetensors preferred)."""
    path = os.path.join(directory, "model.safetensors")
    if os.path.isfile(path):
        from safetensors.torch import load_file

        return load_file(path)
    path = os.path.join(directory, "pytorch_model.bin")
    if os.path.isfile(path):
        return torch.load(path, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{directory}: neither model.safetensors nor pytorch_model.bin")


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--save", required=True)
    parser.add_argument("--tag", default="global_step0")
    args = parser.parse_args(argv)
    with open(os.path.join(args.hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"{args.hf_dir}/config.json: model_type {model_type!r}; megazero imports "
                         f"{', '.join(FAMILIES)}")
    from_hf, model_class = FAMILIES[model_type]
    config, state = from_hf(hf_config, read_hf_state(args.hf_dir))
    has_tokenizer = any(os.path.isfile(os.path.join(args.hf_dir, f)) for f in TOKENIZER_FILES)
    client_state = {"tokenizer": TokenizerSpec("hf", os.path.abspath(args.hf_dir)).to_dict()} if has_tokenizer else {}
    out = write_weights_checkpoint(config, state, args.save, args.tag, model_class=model_class,
                                   client_state=client_state)
    print(f"wrote {out}: {config.num_layers} layers, hidden {config.hidden_size}, "
          f"vocabulary {config.padded_vocab_size}")
    return out


if __name__ == "__main__":
    main()
