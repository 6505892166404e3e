"""Tokenizers the tests build locally from the Shakespeare corpus (no network): a byte-level BPE
trained with the `tokenizers` package, saved as a tokenizer.json, as GPT-2's vocab.json +
merges.txt, and as a tiktoken rank file written from the same merges."""

from __future__ import annotations

import base64
import glob
import json
import os

from tests.conftest import REPO

SHAKESPEARE = os.path.join(REPO, "data", "shakespeare")
EOD = "<|endoftext|>"
HELD_OUT = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n\n"
            "  two  spaces, tabs\t and unicode: café — ½ ✓ 1234567 <b>x</b>\r\n")


def train_byte_level_bpe(directory: str, vocab_size: int = 1000, plays: int = 6) -> dict[str, str]:
    """Train a GPT-2 style byte-level BPE on the first `plays` plays; {"tokenizer_json",
    "vocab_file", "merge_file", "tiktoken", "hf_dir"} paths under `directory`."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    os.makedirs(directory, exist_ok=True)
    model = Tokenizer(BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD], show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    model.train(sorted(glob.glob(os.path.join(SHAKESPEARE, "*.txt")))[:plays], trainer)
    paths = {"tokenizer_json": os.path.join(directory, "tokenizer.json")}
    model.save(paths["tokenizer_json"])
    paths["vocab_file"], paths["merge_file"] = model.model.save(directory)
    paths["tiktoken"] = os.path.join(directory, "bpe.tiktoken")
    write_tiktoken(paths["vocab_file"], paths["tiktoken"])
    paths["hf_dir"] = os.path.join(directory, "hf_dir")
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_file=paths["tokenizer_json"], eos_token=EOD, bos_token=EOD,
                            clean_up_tokenization_spaces=False).save_pretrained(paths["hf_dir"])
    return paths


def write_tiktoken(vocab_file: str, out: str) -> None:
    """A tiktoken rank file of a byte-level BPE's vocabulary: each token's bytes, ranked by id (the
    special token left out, the ranks renumbered from 0)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    with open(vocab_file) as f:
        vocab = json.load(f)
    tokens = sorted((i, t) for t, i in vocab.items() if t != EOD)
    with open(out, "w") as f:
        for rank, (_, token) in enumerate(tokens):
            f.write(f"{base64.b64encode(bytes(byte_of[c] for c in token)).decode()} {rank}\n")
