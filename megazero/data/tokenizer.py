"""The tokenizer protocol, Megatron's `--tokenizer-type` names, and the one factory the recipes,
preprocessing, generation, evaluation and the Hugging Face export build tokenizers with.

    type (Megatron's name or its alias)     files
    GPTSentencePieceTokenizer  sentencepiece   --tokenizer-model TOK.model (preprocess_data.py trains one)
    HuggingFaceTokenizer       hf              --tokenizer-model DIR or tokenizer.json
    TikTokenizer               tiktoken        --tokenizer-model FILE.tiktoken (Llama 3's format)
    GPT2BPETokenizer           gpt2bpe         --vocab-file vocab.json --merge-file merges.txt
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Protocol

# every accepted spelling -> the short name
TOKENIZER_TYPES = {"GPTSentencePieceTokenizer": "sentencepiece", "SentencePieceTokenizer": "sentencepiece",
                   "HuggingFaceTokenizer": "hf", "TikTokenizer": "tiktoken", "GPT2BPETokenizer": "gpt2bpe",
                   "sentencepiece": "sentencepiece", "hf": "hf", "tiktoken": "tiktoken", "gpt2bpe": "gpt2bpe"}


# what the tools' --help says their tokenizer default is
CHECKPOINT_TOKENIZER = "the checkpoint's (its training run's), else sentencepiece data/gpt2/shakespeare_tokenizer.model"


class Tokenizer(Protocol):
    """What megazero asks of a tokenizer."""

    kind: str  # the short type name: sentencepiece, hf, tiktoken, gpt2bpe

    @property
    def vocab_size(self) -> int:
        """Token ids are below this (before any padding for tensor parallelism)."""

    @property
    def eod(self) -> int:
        """The id appended to every document."""

    @property
    def bos(self) -> int | None:
        """The beginning-of-sequence id, if the tokenizer has one."""

    @property
    def pad(self) -> int | None:
        """The padding id, if the tokenizer has one."""

    def token_id(self, piece: str) -> int:
        """Id of a special token (an error naming it when absent)."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of each text (one batch call where the library has one)."""

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`."""

    def save_for_transformers(self, directory: str) -> None:
        """Write the files with which transformers' AutoTokenizer gives these ids and this text."""


def canonical_type(name: str) -> str:
    """The short name of a --tokenizer-type spelling; an error lists the accepted ones."""
    if name not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {name!r}: expected one of {', '.join(TOKENIZER_TYPES)}")
    return TOKENIZER_TYPES[name]


@dataclass(frozen=True)
class TokenizerSpec:
    """Which tokenizer and its files (what the flags say; saved beside datasets and checkpoints)."""

    type: str = "sentencepiece"
    model: str | None = None  # --tokenizer-model
    vocab_file: str | None = None
    merge_file: str | None = None

    def checked(self) -> TokenizerSpec:
        """The spec with its type's short name, and an error when its files are not given."""
        kind = canonical_type(self.type)
        if kind == "gpt2bpe" and not (self.vocab_file and self.merge_file):
            raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file "
                             "(merges.txt)")
        if kind != "gpt2bpe" and not self.model:
            raise ValueError(f"--tokenizer-type {self.type} needs --tokenizer-model")
        return TokenizerSpec(kind, self.model, self.vocab_file, self.merge_file)

    def describe(self) -> str:
        """The type and its files, for messages."""
        files = [self.model] if self.type != "gpt2bpe" else [self.vocab_file, self.merge_file]
        return f"{self.type} {' + '.join(str(f) for f in files)}"

    def absolute(self) -> TokenizerSpec:
        """The spec with its files as absolute paths (to be found again from another directory)."""
        def resolved(path):
            return os.path.abspath(path) if path and os.path.exists(path) else path

        return TokenizerSpec(self.type, resolved(self.model), resolved(self.vocab_file), resolved(self.merge_file))

    def to_dict(self) -> dict:
        """A JSON-ready dict."""
        return asdict(self)


def build_tokenizer(spec: TokenizerSpec, threads: int = -1) -> Tokenizer:
    """The tokenizer `spec` names (`threads`: encode threads where the library has them; -1 all)."""
    spec = spec.checked()
    if spec.type == "sentencepiece":
        from megazero.data.tokenizer_sentencepiece import SentencePieceTokenizer

        return SentencePieceTokenizer(spec.model, threads)
    if spec.type == "tiktoken":
        from megazero.data.tokenizer_tiktoken import TikTokenizer

        return TikTokenizer(spec.model, threads)
    from megazero.data.tokenizer_hf import HuggingFaceTokenizer

    if spec.type == "gpt2bpe":
        return HuggingFaceTokenizer.gpt2_bpe(spec.vocab_file, spec.merge_file, threads)
    return HuggingFaceTokenizer(spec.model, threads)


def resolve_spec(kind: str | None, model: str | None, vocab_file: str | None, merge_file: str | None,
                 default: Callable[[], TokenizerSpec]) -> TokenizerSpec:
    """The checked spec of the tokenizer flags as given: `default()` when none is given; GPT-2's BPE
    when --vocab-file comes without a type (as Megatron's GPT examples give it); a sentencepiece
    type without a model takes default()'s model."""
    if kind is None and model is None and vocab_file is None:
        return default().checked()
    kind = kind or ("gpt2bpe" if vocab_file else "sentencepiece")
    if model is None and canonical_type(kind) == "sentencepiece":
        model = default().model
    return TokenizerSpec(kind, model, vocab_file, merge_file).checked()


def add_tokenizer_args(parser: argparse.ArgumentParser, default_model: str | None = None,
                       default_help: str = "sentencepiece") -> None:
    """Megatron's tokenizer flags on a script's parser (`default_model`: the sentencepiece model
    used when no flag is given and the script has nothing better; `default_help`: what --help says
    the default is)."""
    parser.add_argument("--tokenizer-type", default=None,
                        help=f"one of {', '.join(TOKENIZER_TYPES)} (default: {default_help}; gpt2bpe with "
                             f"--vocab-file)")
    parser.add_argument("--tokenizer-model", default=None,
                        help="sentencepiece .model, Hugging Face tokenizer directory or tokenizer.json, or .tiktoken "
                             "file")
    parser.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: GPT-2's vocab.json")
    parser.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: GPT-2's merges.txt")
    parser.set_defaults(tokenizer_default_model=default_model)


def given_tokenizer(args: argparse.Namespace) -> bool:
    """Whether any of add_tokenizer_args' flags was given."""
    return any(v is not None for v in (args.tokenizer_type, args.tokenizer_model, args.vocab_file))


def tokenizer_from_args(args: argparse.Namespace, saved: TokenizerSpec | None, checkpoint_dir: str):
    """(spec, tokenizer) of the tokenizer flags; without them the one the checkpoint names
    (`saved`), else the script's default. One that cannot be loaded stops the script, naming where
    it came from and the files."""
    spec = spec_from_args(args, saved)
    try:
        return spec, build_tokenizer(spec)
    except (FileNotFoundError, ValueError) as e:
        named = (f"{checkpoint_dir} was trained with the tokenizer {spec.describe()}, which does not load"
                 if saved is not None and not given_tokenizer(args) else f"tokenizer {spec.describe()}")
        raise SystemExit(f"{named}: {e}; give the tokenizer with --tokenizer-type and --tokenizer-model (or "
                         f"--vocab-file and --merge-file)") from None


def spec_from_args(args: argparse.Namespace, fallback: TokenizerSpec | None = None) -> TokenizerSpec:
    """The checked TokenizerSpec of add_tokenizer_args' flags; when none is given, `fallback` (e.g.
    the tokenizer a checkpoint's run used), else the script's default sentencepiece model."""
    return resolve_spec(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
                        lambda: fallback or TokenizerSpec(model=args.tokenizer_default_model))
