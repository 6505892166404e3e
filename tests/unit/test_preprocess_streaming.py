"""Streaming preprocessing (issue 20): the same bytes for any number of workers and partitions
(joined by merge_datasets.py), compressed inputs, and bad jsonl lines named or skipped and counted."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os

import numpy as np
import pytest

from megazero.data import IndexedDataset, SentencePieceTokenizer, train_sentencepiece
from tests.conftest import REPO

WORDS = ["king", "queen", "fool", "ghost", "duke", "maid", "storm", "crown", "sword", "night"]


def _script(name: str):
    """scripts/<name>.py as a module, its main(argv) run in this process (no interpreter start-up)."""
    spec = importlib.util.spec_from_file_location(f"_script_{name}", os.path.join(REPO, "scripts", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _text(rng: np.random.Generator, sentences: int) -> str:
    return " ".join(f"The {rng.choice(WORDS)} saw the {rng.choice(WORDS)}{rng.choice(['.', '!', '?'])}"
                    + ("\n" if rng.random() < 0.3 else "") for _ in range(sentences))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """4 jsonl files (and .gz/.zst copies of them) of 60 documents each, 2 text files, a tokenizer."""
    import zstandard

    root = tmp_path_factory.mktemp("stream")
    rng = np.random.default_rng(0)
    plain, packed = root / "plain", root / "packed"
    plain.mkdir()
    packed.mkdir()
    for i in range(4):
        lines = [json.dumps({"text": _text(rng, int(rng.integers(1, 12))), "id": j}) for j in range(60)]
        lines.insert(7, "")  # blank lines are not documents
        data = ("\n".join(lines) + "\n").encode()
        (plain / f"shard{i}.jsonl").write_bytes(data)
        if i % 2:
            (packed / f"shard{i}.jsonl.gz").write_bytes(gzip.compress(data))
        else:
            (packed / f"shard{i}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    for i in range(2):
        (plain / f"play{i}.txt").write_text(_text(rng, 40))
        (packed / f"play{i}.txt").write_text((plain / f"play{i}.txt").read_text())
    (root / "sample.txt").write_text(_text(rng, 400))
    model = train_sentencepiece([str(root / "sample.txt")], str(root / "tok"), 300)
    return {"root": root, "plain": str(plain), "packed": str(packed), "tokenizer": model}


def _files(prefix: str) -> dict[str, bytes]:
    out = {}
    directory, base = os.path.split(prefix)
    for name in sorted(os.listdir(directory)):
        if name.startswith(base + "_") and name.endswith((".bin", ".idx", "_stats.json")) and "_part" not in name:
            out[name[len(base):]] = open(os.path.join(directory, name), "rb").read()
    return out


def _preprocess(corpus: dict, source: str, prefix: str, *extra: str) -> None:
    _script("preprocess_data")(["--input", corpus[source], "--output-prefix", prefix, "--tokenizer-model",
                                corpus["tokenizer"], "--valid-fraction", "0.1", "--log-interval", "50", *extra])


@pytest.mark.parametrize("sentences", [False, True], ids=["documents", "sentences"])
def test_any_workers_and_partitions_write_the_same_bytes(corpus, tmp_path, sentences):
    """1 worker, 2 workers over many small chunks, and 3 partitions merged by merge_datasets.py: the
    same .bin, .idx and stats; the tokens decode to the documents read."""
    extra = ("--split-sentences",) if sentences else ()
    one = str(tmp_path / "one")
    _preprocess(corpus, "plain", one, *extra)
    reference = _files(one)
    assert len(reference) == 5 and all(reference.values())
    two = str(tmp_path / "two")
    _preprocess(corpus, "plain", two, "--workers", "2", "--chunk-mb", "0.002", *extra)
    assert _files(two) == reference
    parts = str(tmp_path / "parts")
    for i in range(3):
        _preprocess(corpus, "plain", parts, "--partitions", "3", "--partition-index", str(i), *extra)
    _script("merge_datasets")(["--output-prefix", parts, "--partitions", "3"])
    assert _files(parts) == reference
    stats = json.loads(reference["_stats.json"])
    assert stats["train"]["documents"] + stats["valid"]["documents"] == 4 * 60 + 2
    if not sentences:  # a jsonl document round-trips through the tokenizer
        tokenizer = SentencePieceTokenizer(corpus["tokenizer"])
        train = IndexedDataset(one + "_train_text_document")
        path, line = stats["train"]["names"][-1].rsplit(":", 1)
        text = json.loads(open(path).read().split("\n")[int(line) - 1])["text"]
        assert tokenizer.decode(train[len(train) - 1]) == text and train[len(train) - 1][-1] == tokenizer.eod


def test_compressed_inputs_and_one_output_per_input(corpus, tmp_path):
    """.jsonl.gz and .jsonl.zst read as the plain files do; --output-per-input writes P_<stem> each."""
    plain, packed = str(tmp_path / "plain"), str(tmp_path / "packed")
    _preprocess(corpus, "plain", plain, "--workers", "2")
    _preprocess(corpus, "packed", packed)
    for split in ("train", "valid"):
        for ext in (".bin", ".idx"):
            name = f"_{split}_text_document{ext}"
            assert open(plain + name, "rb").read() == open(packed + name, "rb").read(), name
    each = str(tmp_path / "each")
    _script("preprocess_data")(["--input", *(os.path.join(corpus["packed"], f"shard{i}.jsonl.{ext}")
                                             for i, ext in ((0, "zst"), (1, "gz"))),
                                "--output-prefix", each, "--tokenizer-model", corpus["tokenizer"],
                                "--output-per-input"])
    for stem in ("shard0", "shard1"):
        stats = json.load(open(f"{each}_{stem}_stats.json"))
        assert stats["train"]["documents"] + stats["valid"]["documents"] == 60
        assert len(IndexedDataset(f"{each}_{stem}_train_text_document")) == stats["train"]["documents"]


def test_a_bad_line_is_named_or_skipped_and_counted(corpus, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    good = open(os.path.join(corpus["plain"], "shard0.jsonl")).read().split("\n")
    good[11] = '{"text": "cut off'  # line 12
    good[20] = '{"body": "no text key"}'  # line 21
    (bad / "shard0.jsonl").write_text("\n".join(good))
    prefix = str(tmp_path / "out")
    args = ["--input", str(bad), "--output-prefix", prefix, "--tokenizer-model", corpus["tokenizer"]]
    with pytest.raises(SystemExit, match=r"shard0\.jsonl:12: not valid JSON"):
        _script("preprocess_data")(args)
    assert not os.path.exists(prefix + "_train_text_document.idx")
    _script("preprocess_data")(args + ["--skip-bad-lines"])
    stats = json.load(open(prefix + "_stats.json"))
    assert stats["skipped_bad_lines"] == 2 and stats["train"]["documents"] + stats["valid"]["documents"] == 58
    assert "skipped 2 bad line(s)" in capsys.readouterr().err
    good[11] = '{"body": "no text key"}'
    (bad / "shard0.jsonl").write_text("\n".join(good))
    with pytest.raises(SystemExit, match=r"shard0\.jsonl:12: expected a JSON object with a 'text' field"):
        _script("preprocess_data")(args)
