"""Export a GPT checkpoint (any TP/PP/DP layout, any ZeRO stage) as a Hugging Face transformers
GPT2LMHeadModel: config.json, model.safetensors (fp32 masters) and the sentencepiece tokenizer.

    python scripts/export_hf.py --load CKPT --out DIR [--tokenizer-model TOK.model]

Then `transformers.GPT2LMHeadModel.from_pretrained(DIR)` gives the same logits. The vocabulary is
megazero's padded one; bos/eos are the tokenizer's end-of-document token.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megazero.checkpoint.consolidate import consolidate_fp32_state_dict  # noqa: E402
from megazero.data import SentencePieceTokenizer  # noqa: E402
from models.gpt_checkpoint import saved_model_config  # noqa: E402
from models.hf_gpt2 import hf_config_dict, to_hf_state_dict  # noqa: E402


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True)
    parser.add_argument("--tag", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokenizer-model", default=os.path.join(REPO, "data", "gpt2", "shakespeare_tokenizer.model"))
    args = parser.parse_args(argv)
    from safetensors.torch import save_file

    config = saved_model_config(args.load, args.tag)
    tokenizer = SentencePieceTokenizer(args.tokenizer_model)
    state = to_hf_state_dict(consolidate_fp32_state_dict(args.load, args.tag), config)
    os.makedirs(args.out, exist_ok=True)
    save_file(state, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(hf_config_dict(config, tokenizer.eod, tokenizer.eod), f, indent=1)
    shutil.copy(args.tokenizer_model, os.path.join(args.out, "tokenizer.model"))
    print(f"wrote {args.out}: GPT2LMHeadModel, {sum(t.numel() for t in state.values()):,} parameters")
    return args.out


if __name__ == "__main__":
    main()
