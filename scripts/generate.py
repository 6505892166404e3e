"""Generate text from a GPT or Llama checkpoint of any layout (joined into one process), greedy or sampled,
with a KV cache.

    python scripts/generate.py --load CKPT --prompt "ROMEO:" --max-new-tokens 100 \
        [--temperature 0.8 --top-k 40 --top-p 0.95 --seed 1234 --no-kv-cache]

--temperature 0 is greedy decoding; output with and without the KV cache is identical. Only the
model's vocab_size tokens are sampled, never the padding ids megazero adds for tensor parallelism.
"""

from __future__ import annotations

import argparse
import os

import torch

from megazero.checkpoint.model_files import load_model, saved_model_config_dict
from megazero.data import SentencePieceTokenizer
from models.parallelize import MODELS, config_class_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="checkpoint directory (any TP/PP/DP layout, any ZeRO stage)")
    parser.add_argument("--tag", default=None)
    parser.add_argument("--tokenizer-model", default=os.path.join(REPO, "data", "gpt2", "shakespeare_tokenizer.model"))
    parser.add_argument("--prompt", default="ROMEO:\n")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--no-kv-cache", action="store_true", help="recompute the whole context at every step")
    args = parser.parse_args(argv)
    tokenizer = SentencePieceTokenizer(args.tokenizer_model)
    config_class = config_class_for(saved_model_config_dict(args.load, args.tag) or {})  # GPT or Llama
    model = load_model(args.load, args.tag, model_class=MODELS[config_class], config_class=config_class)
    if tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(f"--tokenizer-model {args.tokenizer_model} has {tokenizer.vocab_size} pieces but the model in "
                         f"{args.load} was trained with vocab_size {model.config.vocab_size}")
    torch.manual_seed(args.seed)
    ids = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long)
    out = model.generate(ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         use_kv_cache=not args.no_kv_cache)
    text = tokenizer.decode(out[0].tolist())
    print(text)
    return text


if __name__ == "__main__":
    main()
