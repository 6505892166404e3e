"""A tiktoken BPE file (`.tiktoken`: one "base64-token rank" per line) as Llama 3 uses it
(Megatron's TikTokenizer): Llama 3's split pattern, and its 256 special tokens numbered after the
ranks (<|begin_of_text|>, <|end_of_text|>, ...). `encode` adds no special token; documents end with
<|end_of_text|>.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

# Llama 3's pre-tokenizer pattern (also transformers' TikTokenConverter default)
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
BOS, EOD = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL_TOKENS = ([BOS, EOD] + [f"<|reserved_special_token_{i}|>" for i in range(4)]
                  + ["<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
                  + [f"<|reserved_special_token_{i}|>" for i in range(5, 251)])


class TikTokenizer:
    """encode/decode with tiktoken over a `.tiktoken` rank file; special tokens after the ranks."""

    kind = "tiktoken"

    def __init__(self, path: str, threads: int = -1):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        if not os.path.isfile(path):
            raise FileNotFoundError(f"tiktoken BPE file not found: {path}")
        try:
            ranks = load_tiktoken_bpe(path)
        except Exception as e:  # tiktoken raises bare ValueErrors / binascii errors on a malformed line
            raise ValueError(f"{path}: not a tiktoken BPE file (lines of 'base64-token rank'): {e}") from None
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise ValueError(f"{path}: the ranks are not 0..{len(ranks) - 1} without gaps")
        self.path, self.threads = path, threads if threads > 0 else 8
        self.special = {token: len(ranks) + i for i, token in enumerate(SPECIAL_TOKENS)}
        self.encoding = tiktoken.Encoding(os.path.basename(path), pat_str=PATTERN, mergeable_ranks=ranks,
                                          special_tokens=self.special)

    @property
    def vocab_size(self) -> int:
        """Ranks plus special tokens."""
        return self.encoding.n_vocab

    @property
    def eod(self) -> int:
        """<|end_of_text|>."""
        return self.special[EOD]

    @property
    def bos(self) -> int:
        """<|begin_of_text|> (never added by encode)."""
        return self.special[BOS]

    @property
    def pad(self) -> None:
        """Llama 3 has no pad token."""
        return None

    def token_id(self, piece: str) -> int:
        """Id of a special token; an error names it when it is not one of Llama 3's."""
        if piece not in self.special:
            raise ValueError(f"{self.path}: {piece!r} is not a special token (Llama 3's: {BOS}, {EOD}, ...)")
        return self.special[piece]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (special-token text encoded as ordinary text)."""
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of each text."""
        return self.encoding.encode_ordinary_batch(texts, num_threads=self.threads)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (invalid UTF-8 replaced, as transformers' byte-level decoder does)."""
        return self.encoding.decode([int(i) for i in ids])

    def save_for_transformers(self, directory: str) -> None:
        """tokenizer.json (the ranks as byte-level BPE merges, transformers' TikTokenConverter) and a
        tokenizer_config.json, which AutoTokenizer loads giving these ids."""
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import TikTokenConverter

        converted = TikTokenConverter(vocab_file=self.path, pattern=PATTERN,
                                      extra_special_tokens=SPECIAL_TOKENS).converted()
        hf = PreTrainedTokenizerFast(tokenizer_object=converted, bos_token=BOS, eos_token=EOD,
                                     clean_up_tokenization_spaces=False, model_max_length=1_000_000_000,
                                     split_special_tokens=True)  # special-token text is text, as encode_ordinary
        hf.save_pretrained(directory)
