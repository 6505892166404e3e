"""Export a GPT, BERT or Llama checkpoint (any TP/PP/DP/EP layout, any ZeRO stage) as a Hugging Face
transformers model: GPT2LMHeadModel, BertForPreTraining, LlamaForCausalLM or, for the Llama with
MoE layers, MixtralForCausalLM (models/hf_mixtral.py says which MoE settings map), with
config.json, model.safetensors (fp32 masters) and the tokenizer's files, with which AutoTokenizer
gives megazero's ids and text (a sentencepiece model as a LlamaTokenizer adding no BOS/EOS and no
prefix space; a Hugging Face, GPT-2 BPE or tiktoken tokenizer as its tokenizer.json). The MoE GPT has
no transformers class: an error.

    python scripts/export_hf.py --load CKPT --out DIR [--tokenizer-type T --tokenizer-model M]

The tokenizer is the one the checkpoint's run used (the tokenizer flags, as the recipes take them,
choose another). Then `from_pretrained(DIR)` gives the same logits. The vocabulary is the model's
true one (the padding rows megazero adds for tensor parallelism are left out); GPT's bos/eos are the
tokenizer's end-of-document token, BERT's pad its pad token ([PAD]), the Llama's bos/eos its
beginning-of-sequence (<s>) and end-of-document tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

from megazero.checkpoint.consolidate import consolidate_fp32_state_dict
from megazero.checkpoint.model_files import saved_model_config, saved_model_config_dict, saved_tokenizer_spec
from megazero.data.tokenizer import CHECKPOINT_TOKENIZER, add_tokenizer_args, tokenizer_from_args
from models import hf_bert, hf_llama, hf_mixtral
from models.bert import BertConfig
from models.gpt import GPTConfig
from models.hf_gpt2 import hf_config_dict, to_hf_state_dict
from models.llama import LlamaConfig
from models.parallelize import config_class_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TOKENIZER = os.path.join(REPO, "data", "gpt2", "shakespeare_tokenizer.model")


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True)
    parser.add_argument("--tag", default=None)
    parser.add_argument("--out", required=True)
    add_tokenizer_args(parser, DEFAULT_TOKENIZER, CHECKPOINT_TOKENIZER)
    args = parser.parse_args(argv)
    from safetensors.torch import save_file

    spec, tokenizer = tokenizer_from_args(args, saved_tokenizer_spec(args.load, args.tag), args.load)
    weights = consolidate_fp32_state_dict(args.load, args.tag)
    family = config_class_for(saved_model_config_dict(args.load, args.tag) or {})
    if family is BertConfig:
        config = saved_model_config(args.load, args.tag, config_class=BertConfig)
        state = hf_bert.to_hf_state_dict(weights, config)
        hf_config = hf_bert.hf_config_dict(config, tokenizer.pad if tokenizer.pad is not None else 0)
    elif family is LlamaConfig:
        config = saved_model_config(args.load, args.tag, config_class=LlamaConfig)
        mapping = hf_llama if config.num_experts is None else hf_mixtral
        if mapping is hf_mixtral:
            hf_mixtral.check_exportable(config)
        state = mapping.to_hf_state_dict(weights, config)
        bos = tokenizer.bos if tokenizer.bos is not None else tokenizer.eod
        hf_config = mapping.hf_config_dict(config, bos, tokenizer.eod)
    else:
        config = saved_model_config(args.load, args.tag, config_class=GPTConfig)
        if config.num_experts is not None:
            raise ValueError(f"{args.load}: the GPT has MoE layers (num_experts {config.num_experts}), and "
                             f"transformers has no GPT-2 with experts to export it as; the Llama with MoE layers "
                             f"exports as MixtralForCausalLM")
        state = to_hf_state_dict(weights, config)
        hf_config = hf_config_dict(config, tokenizer.eod, tokenizer.eod)
    if tokenizer.vocab_size != config.vocab_size:  # ids past the embedding would fail in transformers
        warnings.warn(f"the tokenizer {spec.describe()} has {tokenizer.vocab_size} tokens but the model in "
                      f"{args.load} has a vocabulary of {config.vocab_size}: the export's tokenizer does not "
                      f"match its model; pass this model's tokenizer with --tokenizer-model", stacklevel=2)
    os.makedirs(args.out, exist_ok=True)
    weights_path = os.path.join(args.out, "model.safetensors")
    save_file(state, weights_path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights_path, 0o666 & ~umask)  # as the other files: readable by whoever loads the export
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1)
    tokenizer.save_for_transformers(args.out)
    print(f"wrote {args.out}: {hf_config['architectures'][0]}, {sum(t.numel() for t in state.values()):,} weights, "
          f"tokenizer {spec.describe()}")
    return args.out


if __name__ == "__main__":
    main()
