"""A sentencepiece tokenizer that round-trips text exactly (newlines and spacing included): the one
`scripts/preprocess_data.py` trains when no tokenizer is given (Megatron's GPTSentencePieceTokenizer)."""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterable

NEWLINE = "\n"


def train_sentencepiece(files: list[str], model_prefix: str, vocab_size: int = 8000,
                        model_type: str = "bpe", num_threads: int = 2, special_tokens: Iterable[str] = ()) -> str:
    """Train a model on text files; returns the .model path.

    Identity normalisation, no dummy prefix and a newline piece, so decode(encode(text)) == text;
    byte fallback makes any text encodable. `special_tokens` (e.g. BERT's [CLS] [SEP] [MASK]
    [PAD]) get pieces of their own.
    """
    import sentencepiece as spm

    os.makedirs(os.path.dirname(model_prefix) or ".", exist_ok=True)
    try:
        _train(spm, files, model_prefix, vocab_size, model_type, num_threads, special_tokens)
    except RuntimeError as e:  # sentencepiece's INTERNAL errors, e.g. a vocabulary larger than the corpus allows
        hint = " (a smaller --vocab-size)" if "Vocabulary size" in str(e) else ""
        raise ValueError(f"training a sentencepiece tokenizer on {files}: {str(e).splitlines()[-1]}{hint}") from None
    return model_prefix + ".model"


def _train(spm, files, model_prefix, vocab_size, model_type, num_threads, special_tokens) -> None:
    spm.SentencePieceTrainer.train(
        input=files, model_prefix=model_prefix, vocab_size=vocab_size, model_type=model_type,
        user_defined_symbols=[NEWLINE, *special_tokens], add_dummy_prefix=False, remove_extra_whitespaces=False,
        normalization_rule_name="identity", byte_fallback=True, character_coverage=1.0,
        num_threads=num_threads, minloglevel=2)


class SentencePieceTokenizer:
    """encode/decode with a trained sentencepiece model; `eod` (its </s>) ends every document.
    `threads`: sentencepiece's threads for a batch encode (-1: every core)."""

    kind = "sentencepiece"

    def __init__(self, model_path: str, threads: int = -1):
        import sentencepiece as spm

        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"tokenizer model not found: {model_path}")
        self.model_path = model_path
        self.sp = spm.SentencePieceProcessor(model_file=model_path, num_threads=threads)
        self.newline_id = self.sp.piece_to_id(NEWLINE)
        if self.sp.id_to_piece(self.newline_id) != NEWLINE:
            raise ValueError(f"{model_path} has no newline piece: train it with megazero's train_sentencepiece")

    @property
    def vocab_size(self) -> int:
        """Number of pieces (before any padding for tensor parallelism)."""
        return self.sp.get_piece_size()

    @property
    def eod(self) -> int:
        """End-of-document id (sentencepiece's </s>)."""
        return self.sp.eos_id()

    @property
    def bos(self) -> int | None:
        """Beginning-of-sequence id (<s>; never added by encode)."""
        return self.sp.bos_id() if self.sp.bos_id() >= 0 else None

    @property
    def pad(self) -> int | None:
        """The [PAD] piece's id when the model has one."""
        i = self.sp.piece_to_id("[PAD]")
        return i if self.sp.id_to_piece(i) == "[PAD]" else None

    def token_id(self, piece: str) -> int:
        """Id of a special piece such as "[MASK]"; an error names it when the model lacks it."""
        i = self.sp.piece_to_id(piece)
        if self.sp.id_to_piece(i) != piece:
            raise ValueError(f"{self.model_path} has no piece {piece!r}: train it with special_tokens=[{piece!r}, ...]")
        return i

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of each text: every line of every text in one sentencepiece call (much faster
        than a call per string), the lines joined by the newline piece."""
        lines = [t.split(NEWLINE) for t in texts]
        flat = self.sp.encode(list(itertools.chain.from_iterable(lines)))
        out, first = [], 0
        for count in map(len, lines):
            ids = flat[first]
            for more in flat[first + 1:first + count]:
                ids.append(self.newline_id)
                ids.extend(more)
            out.append(ids)
            first += count
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (control ids such as eod decode to nothing)."""
        return self.sp.decode([int(i) for i in ids])

    def save_for_transformers(self, directory: str) -> None:
        """tokenizer.model and a tokenizer_config.json with which AutoTokenizer loads it as a
        LlamaTokenizer giving these ids and this text (no BOS or EOS added, no prefix space,
        special-token text such as "</s>" encoded as text)."""
        import json

        sp = self.sp
        # split_special_tokens: "</s>" in a text is text, as sentencepiece encodes it, not the special id
        config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
                  "legacy": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
                  "split_special_tokens": True,
                  "bos_token": sp.id_to_piece(sp.bos_id()), "eos_token": sp.id_to_piece(sp.eos_id()),
                  "unk_token": sp.id_to_piece(sp.unk_id()), "model_max_length": 1_000_000_000}
        for role, piece in (("pad_token", "[PAD]"), ("cls_token", "[CLS]"), ("sep_token", "[SEP]"),
                            ("mask_token", "[MASK]")):
            if sp.id_to_piece(sp.piece_to_id(piece)) == piece:
                config[role] = piece
        shutil.copy(self.model_path, os.path.join(directory, "tokenizer.model"))
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=1)
