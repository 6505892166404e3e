"""Bad data files (issue 14, item 6): real datasets made by scripts/preprocess_data.py, then
truncated or corrupted on disk. Each fault is an error naming the file with what was expected and
what was found, raised while the datasets are built, before any training step (and the recipes
exit with it, every rank)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from megazero.data import (
    DatasetFormatError,
    GPTDataset,
    IndexedDataset,
    SentencePieceTokenizer,
    check_token_ids,
    write_indexed_dataset,
)
from megazero.data.bert_dataset import BertDataset
from megazero.data.indexed_dataset import MAGIC
from tests.conftest import REPO

PLAYS = ["macbeth_gut.txt", "tempest_gut.txt", "othello_gut.txt", "julius_caesar_gut.txt", "sonnets_gut.txt"]
SPECIAL = ["[CLS]", "[SEP]", "[MASK]", "[PAD]"]
# header offsets in the .idx: magic, version (u64), dtype code (u8), sequence count (u64), document count (u64)
VERSION_AT, CODE_AT, COUNT_AT = len(MAGIC), len(MAGIC) + 8, len(MAGIC) + 9
HEADER = len(MAGIC) + 25


def _preprocess(out: str, *extra: str) -> None:
    inputs = [os.path.join(REPO, "data", "shakespeare", name) for name in PLAYS]
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "preprocess_data.py"), "--input", *inputs,
                    "--output-prefix", out, "--valid-fraction", "0.2", *extra], check=True, capture_output=True)


@pytest.fixture(scope="module")
def made(corpus_prefix, tmp_path_factory) -> dict[str, str]:
    """Prefixes of real preprocessed data: a 1000-piece tokenizer's documents (GPT) and sentences
    (BERT), and a second, 400-piece tokenizer trained on other text."""
    root = tmp_path_factory.mktemp("made")
    big = str(root / "big")
    _preprocess(big, "--vocab-size", "1000", "--split-sentences", "--special-tokens", *SPECIAL)
    _preprocess(big, "--tokenizer-model", big + "_tokenizer.model")  # the GPT documents, same tokenizer
    small = str(root / "small")
    _preprocess(small, "--vocab-size", "400", "--special-tokens", *SPECIAL)
    return {"gpt": big + "_train_text_document", "valid": big + "_valid_text_document",
            "bert": big + "_train_text_sentence", "tokenizer": big + "_tokenizer.model",
            "small_tokenizer": small + "_tokenizer.model", "root": str(root)}


def _copy(prefix: str, dest) -> str:
    out = str(dest / "copy")
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, out + ext)
    return out


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _error(prefix: str) -> str:
    with pytest.raises(DatasetFormatError) as info:
        IndexedDataset(prefix)
    return str(info.value)


def test_the_real_files_load(made):
    """The control: the untouched files build every dataset with their own tokenizer."""
    vocab = SentencePieceTokenizer(made["tokenizer"]).vocab_size
    assert vocab == 1000
    assert len(GPTDataset(IndexedDataset(made["gpt"]), 64, vocab_size=vocab)) > 100
    assert 900 <= check_token_ids(IndexedDataset(made["bert"]), vocab, made["tokenizer"]) < vocab


@pytest.mark.parametrize("cut", [2, 1, 4096])
def test_truncated_bin(made, tmp_path, cut):
    prefix = _copy(made["gpt"], tmp_path)
    size = os.path.getsize(prefix + ".bin")
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(size - cut)
    message = _error(prefix)
    assert message.startswith(f"{prefix}.bin: {size - cut} bytes, but {prefix}.idx describes {size} ")
    assert "truncated or mismatched" in message


def test_idx_of_another_bin(made, tmp_path):
    prefix = _copy(made["gpt"], tmp_path)
    shutil.copy(made["valid"] + ".idx", prefix + ".idx")  # the validation split's index with the train .bin
    expected = int(IndexedDataset(made["valid"]).sizes.sum()) * 2
    message = _error(prefix)
    assert message.startswith(f"{prefix}.bin: {os.path.getsize(prefix + '.bin')} bytes, but {prefix}.idx describes "
                              f"{expected} ")


@pytest.mark.parametrize("fault", ["magic", "not_an_index", "empty", "version", "unknown_code", "wrong_code",
                                   "count", "pointer", "size", "document_index"])
def test_corrupt_idx_header(made, tmp_path, fault):
    prefix = _copy(made["gpt"], tmp_path)
    idx = prefix + ".idx"
    count = struct.unpack_from("<Q", open(idx, "rb").read(), COUNT_AT)[0]
    sizes_at, pointers_at = HEADER, HEADER + 4 * count
    docs_at = pointers_at + 8 * count
    if fault == "magic":
        _patch(idx, 0, b"NOTANIDX\x00")
        expected = f"{idx}: not an MMIDIDX index (bad magic): starts with b'NOTANIDX\\x00', expected {MAGIC!r}"
    elif fault == "not_an_index":
        shutil.copy(prefix + ".bin", idx)
        expected = f"{idx}: not an MMIDIDX index (bad magic): starts with "
    elif fault == "empty":
        open(idx, "wb").close()
        expected = f"{idx}: not an MMIDIDX index (bad magic): starts with b''"
    elif fault == "version":
        _patch(idx, VERSION_AT, struct.pack("<Q", 2))
        expected = f"{idx}: version 2, expected 1"
    elif fault == "unknown_code":
        _patch(idx, CODE_AT, struct.pack("<B", 9))
        expected = f"{idx}: unknown dtype code 9, expected one of 1 uint8, 2 int8, "
    elif fault == "wrong_code":  # int32 where the .bin holds uint16
        _patch(idx, CODE_AT, struct.pack("<B", 4))
        expected = f"{idx}: sequence 1 starts at byte "
    elif fault == "count":
        _patch(idx, COUNT_AT, struct.pack("<Q", count + 1))
        size = os.path.getsize(idx)
        expected = f"{idx}: {size} bytes, expected {size + 12} for {count + 1} sequences"
    elif fault == "pointer":
        _patch(idx, pointers_at + 8 * 3, struct.pack("<q", 2))
        expected = f"{idx}: sequence 3 starts at byte 2, expected "
    elif fault == "size":
        _patch(idx, sizes_at + 4 * 2, struct.pack("<i", -5))
        expected = f"{idx}: sequence 2 has size -5, expected >= 0"
    else:
        _patch(idx, docs_at + 8 * count, struct.pack("<q", count + 7))
        expected = f"{idx}: document index must rise from 0 to the sequence count {count}, found 0 .. {count + 7}"
    message = _error(prefix)
    assert expected in message, message
    if fault == "wrong_code":
        assert ("before it, in int32); corrupt header (they are offsets of int16 or uint16 tokens: "
                "a wrong dtype code?)") in message


def test_wrong_dtype_code_of_a_single_sequence(tmp_path):
    """One sequence: its pointer (0) fits any dtype, so the .bin's size is what tells."""
    prefix = str(tmp_path / "one")
    write_indexed_dataset(prefix, [np.arange(300, dtype=np.uint16)], np.uint16)
    _patch(prefix + ".idx", CODE_AT, struct.pack("<B", 4))  # int32
    assert _error(prefix) == (f"{prefix}.bin: 600 bytes, but {prefix}.idx describes 1200 (300 tokens of int32); "
                              f"truncated or mismatched (that is the size of 300 tokens of int16 or uint16: "
                              f"a wrong dtype code?)")


def test_tokenizer_smaller_than_the_data_vocab(made):
    small = SentencePieceTokenizer(made["small_tokenizer"])
    assert small.vocab_size == 400
    indexed = IndexedDataset(made["gpt"])
    top = int(indexed.tokens.max())
    first = int(np.flatnonzero(indexed.tokens >= 400)[0])
    with pytest.raises(DatasetFormatError) as info:
        GPTDataset(indexed, 64, vocab_size=small.vocab_size)
    assert str(info.value).startswith(f"{made['gpt']}.bin: token id {top} found (first id >= 400: "
                                      f"{int(indexed.tokens[first])} at token {first}, sequence ")
    assert "has vocab size 400: expected ids in [0, 400)" in str(info.value)
    with pytest.raises(DatasetFormatError, match=f"but the tokenizer {made['small_tokenizer']} has vocab size 400"):
        check_token_ids(indexed, small.vocab_size, made["small_tokenizer"])
    special = {piece: small.token_id(piece) for piece in SPECIAL}
    with pytest.raises(DatasetFormatError, match=r"_train_text_sentence\.bin: token id \d+ found .* vocab size 400"):
        BertDataset(IndexedDataset(made["bert"]), 64, special, small.vocab_size)


def _recipe(script: str, prefix: str, tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "scripts", script), "--data-path", prefix, "--num-layers", "2",
           "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--global-batch-size", "16",
           "--micro-batch-size", "4", "--train-iters", "5", "--log-interval", "1", "--peak-flops", "1e11", *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600, cwd=str(tmp_path))
    return proc, time.perf_counter() - start


@pytest.mark.slow
def test_gpt_recipe_stops_on_a_truncated_bin_before_training(made, tmp_path):
    prefix = str(tmp_path / "data")
    for split in ("train", "valid"):
        for ext in (".bin", ".idx"):
            shutil.copy(made["root"] + f"/big_{split}_text_document{ext}", f"{prefix}_{split}_text_document{ext}")
    size = os.path.getsize(prefix + "_train_text_document.bin")
    with open(prefix + "_train_text_document.bin", "r+b") as f:
        f.truncate(size - 1000)
    proc, _ = _recipe("pretrain_gpt.py", prefix, tmp_path, "--tokenizer-model", made["tokenizer"])
    assert proc.returncode != 0
    message = f"DatasetFormatError: {prefix}_train_text_document.bin: {size - 1000} bytes, but "
    assert proc.stderr.count(message) >= 2, proc.stderr[-4000:]  # both ranks
    assert " iteration " not in proc.stdout


@pytest.mark.slow
def test_bert_recipe_stops_on_a_mismatched_tokenizer_before_training(made, tmp_path):
    proc, _ = _recipe("pretrain_bert.py", made["bert"].removesuffix("_train_text_sentence"), tmp_path,
                      "--tokenizer-model", made["small_tokenizer"])
    assert proc.returncode != 0
    assert proc.stderr.count("_train_text_sentence.bin: token id ") >= 2, proc.stderr[-4000:]
    assert "but the tokenizer has vocab size 400: expected ids in [0, 400)" in proc.stderr
    assert " iteration " not in proc.stdout
