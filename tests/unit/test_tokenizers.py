"""Every --tokenizer-type on tokenizers built locally from the corpus: the library's own ids, exact
round trips, the flags as Megatron spells them, and every export (GPT-2, BERT, Llama, Mixtral)
loading with transformers' AutoTokenizer giving megazero's ids and text."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from megazero.checkpoint.model_files import write_weights_checkpoint
from megazero.data import TokenizerSpec, build_tokenizer
from megazero.data.tokenizer import add_tokenizer_args, spec_from_args
from models.bert import Bert, BertConfig
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from tests.conftest import CORPUS_PREFIX
from tests.hf_helpers import require_transformers
from tests.tokenizer_helpers import EOD, HELD_OUT

SENTENCEPIECE = CORPUS_PREFIX + "_tokenizer.model"
KINDS = ["sentencepiece", "hf_json", "hf_dir", "gpt2bpe", "tiktoken"]


def spec_of(kind: str, files: dict[str, str]) -> TokenizerSpec:
    """The spec of each kind of tokenizer under test (Megatron's type names)."""
    return {"sentencepiece": TokenizerSpec("GPTSentencePieceTokenizer", SENTENCEPIECE),
            "hf_json": TokenizerSpec("HuggingFaceTokenizer", files["tokenizer_json"]),
            "hf_dir": TokenizerSpec("HuggingFaceTokenizer", files["hf_dir"]),
            "gpt2bpe": TokenizerSpec("GPT2BPETokenizer", vocab_file=files["vocab_file"],
                                     merge_file=files["merge_file"]),
            "tiktoken": TokenizerSpec("TikTokenizer", files["tiktoken"])}[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_exact_and_eod_ends_documents(kind, byte_level_bpe, corpus_prefix):
    tokenizer = build_tokenizer(spec_of(kind, byte_level_bpe))
    ids = tokenizer.encode(HELD_OUT)
    assert tokenizer.decode(ids) == HELD_OUT
    assert tokenizer.encode_batch([HELD_OUT, "", "a\nb"]) == [ids, tokenizer.encode(""), tokenizer.encode("a\nb")]
    assert max(ids) < tokenizer.vocab_size and tokenizer.eod not in ids
    assert tokenizer.eod < tokenizer.vocab_size


def test_ids_are_the_libraries_own(byte_level_bpe):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(byte_level_bpe["tokenizer_json"]).encode(HELD_OUT).ids
    for kind in ("hf_json", "hf_dir", "gpt2bpe"):
        assert build_tokenizer(spec_of(kind, byte_level_bpe)).encode(HELD_OUT) == reference, kind
        assert build_tokenizer(spec_of(kind, byte_level_bpe)).eod == reference_eod(byte_level_bpe)
    ranks = load_tiktoken_bpe(byte_level_bpe["tiktoken"])
    plain = tiktoken.Encoding("plain", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})
    ours = build_tokenizer(spec_of("tiktoken", byte_level_bpe))
    from megazero.data.tokenizer_tiktoken import PATTERN

    own = tiktoken.Encoding("own", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens={})
    assert ours.encode(HELD_OUT) == own.encode_ordinary(HELD_OUT)
    assert ours.encode(HELD_OUT) != plain.encode_ordinary(HELD_OUT)  # the pattern is Llama 3's, not any split
    # the rank file is the BPE's vocabulary less <|endoftext|> (id 0): the same merges give ids one lower
    assert [i - 1 for i in reference] == ours.encode(HELD_OUT)
    assert ours.vocab_size == len(ranks) + 256 and ours.eod == len(ranks) + 1  # Llama 3's specials after the ranks


def reference_eod(files: dict[str, str]) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(files["tokenizer_json"]).token_to_id(EOD)


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_tokenizer_args(parser, "default.model")
    return parser.parse_args(list(flags))


def test_the_flags_as_megatron_spells_them():
    assert spec_from_args(_args()) == TokenizerSpec("sentencepiece", "default.model")
    saved = TokenizerSpec("hf", "tok.json")
    assert spec_from_args(_args(), saved) == saved  # e.g. the tokenizer a checkpoint's run used
    assert spec_from_args(_args("--tokenizer-model", "x.model"), saved) == TokenizerSpec("sentencepiece", "x.model")
    # Megatron's GPT examples give --vocab-file and --merge-file alone: GPT-2's BPE
    assert spec_from_args(_args("--vocab-file", "v.json", "--merge-file", "m.txt")) == TokenizerSpec(
        "gpt2bpe", None, "v.json", "m.txt")
    tiktoken = spec_from_args(_args("--tokenizer-type", "TikTokenizer", "--tokenizer-model", "t.tiktoken"))
    assert tiktoken == TokenizerSpec("tiktoken", "t.tiktoken")
    with pytest.raises(ValueError, match="--tokenizer-type 'Bogus': expected one of GPTSentencePieceTokenizer"):
        spec_from_args(_args("--tokenizer-type", "Bogus"))
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --vocab-file .* and --merge-file"):
        spec_from_args(_args("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"))
    with pytest.raises(ValueError, match="--tokenizer-type hf needs --tokenizer-model"):
        spec_from_args(_args("--tokenizer-type", "hf"))


def test_missing_and_malformed_files_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer not found: .*nope.json"):
        build_tokenizer(TokenizerSpec("hf", str(tmp_path / "nope.json")))
    (tmp_path / "bad.tiktoken").write_text("not base64 at all\n")
    with pytest.raises(ValueError, match="bad.tiktoken: not a tiktoken BPE file"):
        build_tokenizer(TokenizerSpec("tiktoken", str(tmp_path / "bad.tiktoken")))
    with pytest.raises(FileNotFoundError, match="--merge-file .*merges.txt: not found"):
        build_tokenizer(TokenizerSpec("gpt2bpe", vocab_file=SENTENCEPIECE, merge_file=str(tmp_path / "merges.txt")))


def _family_checkpoint(tmp_path, family: str, vocab: int) -> str:
    """A weights-only checkpoint of a seeded random tiny model of `family` with `vocab` tokens."""
    shape = dict(vocab_size=vocab, seq_length=16, num_layers=1, hidden_size=32, num_attention_heads=2)
    config, model_class = {
        "gpt": (lambda: GPTConfig(**shape), GPT),
        "bert": (lambda: BertConfig(**shape), Bert),
        "llama": (lambda: LlamaConfig(**shape, ffn_hidden_size=64), Llama),
        "mixtral": (lambda: LlamaConfig(**shape, ffn_hidden_size=64, num_experts=2, moe_router_topk=2,
                                        moe_router_score_order="topk_softmax"), Llama),
    }[family]
    config = config()
    torch.manual_seed(0)
    save = str(tmp_path / f"{family}_ckpt")
    write_weights_checkpoint(config, model_class(config).state_dict(), save, model_class=model_class)
    return save


@pytest.mark.parametrize("family", ["gpt", "bert", "llama", "mixtral"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_export_loads_with_autotokenizer_giving_megazeros_ids(kind, family, byte_level_bpe, corpus_prefix,
                                                                    tmp_path):
    require_transformers()
    import json

    from transformers import AutoTokenizer

    from scripts.export_hf import main as export

    spec = spec_of(kind, byte_level_bpe)
    ours = build_tokenizer(spec)
    flags = (["--vocab-file", spec.vocab_file, "--merge-file", spec.merge_file] if spec.vocab_file
             else ["--tokenizer-model", spec.model])
    out = export(["--load", _family_checkpoint(tmp_path, family, ours.vocab_size), "--out", str(tmp_path / "hf"),
                  "--tokenizer-type", spec.type, *flags])
    hf = AutoTokenizer.from_pretrained(out)
    ids = hf(HELD_OUT)["input_ids"]
    assert ids == ours.encode(HELD_OUT)
    assert hf.decode(ids) == ours.decode(ids) == HELD_OUT
    assert len(hf) == ours.vocab_size and hf.eos_token_id == ours.eod
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["vocab_size"] == ours.vocab_size
    if family != "bert":
        assert config["eos_token_id"] == ours.eod
