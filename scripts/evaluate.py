"""Validation loss and perplexity of a GPT or Llama checkpoint (any layout) on an indexed dataset or a raw
text file, with a sliding window for texts longer than the model's context.

    python scripts/evaluate.py --load CKPT --data-path data/gpt2/shakespeare_valid_text_document
    python scripts/evaluate.py --load CKPT --text-file book.txt [--stride 128] [--tokenizer-type T --tokenizer-model M]

Windows of seq_length tokens start every --stride tokens (default: seq_length, no overlap); each
token is scored once, in the first window where it is not in the overlap, so with a smaller stride
every prediction sees at least seq_length - stride tokens of context. A text file is tokenized with
the tokenizer the checkpoint's run used (the tokenizer flags, as the recipes take them, choose another).
"""

from __future__ import annotations

import argparse
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

from megazero.checkpoint.model_files import load_model, saved_model_config_dict, saved_tokenizer_spec
from megazero.data import IndexedDataset
from megazero.data.tokenizer import CHECKPOINT_TOKENIZER, add_tokenizer_args, tokenizer_from_args
from models.parallelize import MODELS, config_class_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TOKENIZER = os.path.join(REPO, "data", "gpt2", "shakespeare_tokenizer.model")


@torch.no_grad()
def sliding_window_loss(model, tokens: torch.Tensor, window: int, stride: int) -> tuple[float, int]:
    """(mean loss, tokens scored) over the token stream, each target scored once."""
    if not 0 < stride <= window:
        raise ValueError(f"--stride must be in 1..{window}, got {stride}")
    if len(tokens) < 2:
        raise ValueError("need at least two tokens to evaluate")
    jobs = []  # (start, first scored target position within the window)
    scored_until = 0  # targets [1, scored_until] of the stream are scored
    for start in range(0, len(tokens) - 1, stride):
        end = min(start + window, len(tokens) - 1)
        first = scored_until - start  # window positions before this were scored by earlier windows
        jobs.append((start, end, max(first, 0)))
        scored_until = end
        if end == len(tokens) - 1:
            break
    total, count = 0.0, 0
    for start, end, first in jobs:
        labels = tokens[start + 1:end + 1]
        logits = model(tokens[start:end].unsqueeze(0))[0, first:].float()
        total += float(F.cross_entropy(logits, labels[first:], reduction="sum"))
        count += len(labels) - first
    return total / count, count


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True)
    parser.add_argument("--tag", default=None)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data-path", help="indexed dataset prefix (.bin/.idx)")
    source.add_argument("--text-file", help="raw text, tokenised on the fly")
    add_tokenizer_args(parser, DEFAULT_TOKENIZER, CHECKPOINT_TOKENIZER)
    parser.add_argument("--stride", type=int, default=None, help="default: the model's seq_length")
    parser.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens")
    args = parser.parse_args(argv)
    config_class = config_class_for(saved_model_config_dict(args.load, args.tag) or {})  # GPT or Llama
    model = load_model(args.load, args.tag, model_class=MODELS[config_class], config_class=config_class)
    if args.data_path:
        tokens = torch.from_numpy(np.asarray(IndexedDataset(args.data_path).tokens, dtype=np.int64))
    else:
        with open(args.text_file, encoding="utf-8") as f:
            spec, tokenizer = tokenizer_from_args(args, saved_tokenizer_spec(args.load, args.tag), args.load)
            if tokenizer.vocab_size != model.config.vocab_size:
                raise ValueError(f"the tokenizer {spec.describe()} has {tokenizer.vocab_size} tokens but the model in "
                                 f"{args.load} was trained with vocab_size {model.config.vocab_size}")
            tokens = torch.tensor(tokenizer.encode(f.read()), dtype=torch.long)
    if args.max_tokens:
        tokens = tokens[:args.max_tokens]
    window = model.config.seq_length
    loss, count = sliding_window_loss(model, tokens, window, args.stride or window)
    result = {"loss": loss, "perplexity": math.exp(loss), "tokens": count}
    print(f"{count:,} tokens | loss {loss:.4f} | perplexity {math.exp(loss):.2f}")
    return result


if __name__ == "__main__":
    main()
