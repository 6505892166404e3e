"""Hugging Face tokenizers: a saved tokenizer directory or `tokenizer.json` (Megatron's
HuggingFaceTokenizer), and GPT-2's own `vocab.json` + `merges.txt` (Megatron's GPT2BPETokenizer).

Both run through transformers' fast tokenizer, so the ids are the ones `AutoTokenizer` gives:
`encode` adds what the tokenizer's own post-processor adds (a Llama 3 tokenizer.json prepends
<|begin_of_text|>; GPT-2 adds nothing), as Megatron's HuggingFaceTokenizer does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

# end-of-document tokens recognised in a bare tokenizer.json that names no eos_token (GPT-2,
# Llama 3, Llama 2 / Mistral, Gemma)
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
GPT2_EOD = "<|endoftext|>"


class HuggingFaceTokenizer:
    """A transformers fast tokenizer as a megazero tokenizer. `path`: a directory holding
    tokenizer.json (and its tokenizer_config.json) or a tokenizer.json file."""

    kind = "hf"

    def __init__(self, path: str, threads: int = -1, *, _loaded=None):
        if threads == 1:  # a preprocessing worker: the processes are the parallelism
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.path = path
        self.hf = _loaded if _loaded is not None else _load(path)
        if self.hf.eos_token_id is None:
            raise ValueError(f"{path}: no end-of-document token: name it as eos_token in a tokenizer_config.json "
                             f"beside tokenizer.json (none of {', '.join(EOD_CANDIDATES)} is in the vocabulary)")

    @classmethod
    def gpt2_bpe(cls, vocab_file: str, merge_file: str, threads: int = -1) -> HuggingFaceTokenizer:
        """GPT-2's byte-level BPE from its vocab.json and merges.txt, <|endoftext|> ending documents."""
        from tokenizers import Tokenizer, decoders, pre_tokenizers
        from tokenizers.models import BPE
        from transformers import PreTrainedTokenizerFast

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise FileNotFoundError(f"{flag} {path}: not found (GPT2BPETokenizer reads GPT-2's vocab.json "
                                        f"and merges.txt)")
        model = Tokenizer(BPE.from_file(vocab_file, merge_file))
        model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        model.decoder = decoders.ByteLevel()
        if model.token_to_id(GPT2_EOD) is None:
            raise ValueError(f"{vocab_file}: no {GPT2_EOD} token, which ends GPT-2's documents")
        model.add_special_tokens([GPT2_EOD])
        hf = PreTrainedTokenizerFast(tokenizer_object=model, bos_token=GPT2_EOD, eos_token=GPT2_EOD,
                                     unk_token=GPT2_EOD, clean_up_tokenization_spaces=False)
        made = cls(vocab_file, threads, _loaded=hf)
        made.kind = "gpt2bpe"
        return made

    @property
    def vocab_size(self) -> int:
        """Tokens including the added ones (len(tokenizer), as Megatron counts them)."""
        return len(self.hf)

    @property
    def eod(self) -> int:
        """End-of-document id (the tokenizer's eos_token)."""
        return self.hf.eos_token_id

    @property
    def bos(self) -> int | None:
        """The tokenizer's bos_token id, if any."""
        return self.hf.bos_token_id

    @property
    def pad(self) -> int | None:
        """The tokenizer's pad_token id, if any."""
        return self.hf.pad_token_id

    def token_id(self, piece: str) -> int:
        """Id of a special token such as "[MASK]"; an error names it when the vocabulary lacks it."""
        i = self.hf.convert_tokens_to_ids(piece)
        if i is None or i == self.hf.unk_token_id and piece != self.hf.unk_token:
            raise ValueError(f"{self.path} has no token {piece!r}")
        return i

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, as AutoTokenizer(text)["input_ids"]."""
        return self.hf(text)["input_ids"]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of each text, in one batch call."""
        return self.hf(texts)["input_ids"] if texts else []

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (special tokens included, as transformers' decode)."""
        return self.hf.decode([int(i) for i in ids])

    def save_for_transformers(self, directory: str) -> None:
        """tokenizer.json and tokenizer_config.json, which AutoTokenizer loads as this tokenizer."""
        self.hf.save_pretrained(directory)


def _load(path: str):
    """A transformers tokenizer from a directory (AutoTokenizer; one holding only tokenizer.json:
    that file) or a bare tokenizer.json, its eos_token set from EOD_CANDIDATES where it names none."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.isdir(path):
        has = {f for f in ("tokenizer.json", "tokenizer_config.json") if os.path.isfile(os.path.join(path, f))}
        if not has:
            raise FileNotFoundError(f"{path}: no tokenizer.json or tokenizer_config.json (a Hugging Face tokenizer "
                                    f"saved with save_pretrained)")
        if has == {"tokenizer.json"}:
            return _load(os.path.join(path, "tokenizer.json"))
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer not found: {path} (a tokenizer.json or a directory holding one)")
    else:
        with open(path) as f:
            try:
                json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: not a Hugging Face tokenizer.json ({e})") from None
        hf = PreTrainedTokenizerFast(tokenizer_file=path, clean_up_tokenization_spaces=False)
    if hf.eos_token is None:
        vocab = hf.get_vocab()
        eod = next((t for t in EOD_CANDIDATES if t in vocab), None)
        if eod is not None:
            hf.eos_token = eod
    return hf
