"""A sentencepiece tokenizer that round-trips text exactly (newlines and spacing included)."""

from __future__ import annotations

import os
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
    spm.SentencePieceTrainer.train(
        input=files, model_prefix=model_prefix, vocab_size=vocab_size, model_type=model_type,
        user_defined_symbols=[NEWLINE, *special_tokens], add_dummy_prefix=False, remove_extra_whitespaces=False,
        normalization_rule_name="identity", byte_fallback=True, character_coverage=1.0,
        num_threads=num_threads, minloglevel=2)
    return model_prefix + ".model"


class SentencePieceTokenizer:
    """encode/decode with a trained sentencepiece model; `eod` ends every document."""

    def __init__(self, model_path: str):
        import sentencepiece as spm

        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"tokenizer model not found: {model_path}")
        self.model_path = model_path
        self.sp = spm.SentencePieceProcessor(model_file=model_path)
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

    def token_id(self, piece: str) -> int:
        """Id of a special piece such as "[MASK]"; an error names it when the model lacks it."""
        i = self.sp.piece_to_id(piece)
        if self.sp.id_to_piece(i) != piece:
            raise ValueError(f"{self.model_path} has no piece {piece!r}: train it with special_tokens=[{piece!r}, ...]")
        return i

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; lines are encoded in one batch call (much faster than one string)."""
        lines = text.split(NEWLINE)
        ids: list[int] = []
        for i, line_ids in enumerate(self.sp.encode(lines)):
            if i:
                ids.append(self.newline_id)
            ids.extend(line_ids)
        return ids

    def encode_documents(self, texts: Iterable[str]) -> list[list[int]]:
        """encode() of each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (control ids such as eod decode to nothing)."""
        return self.sp.decode([int(i) for i in ids])
