"""Hugging Face datasets as preprocessing input: parquet files, arrow files and a `save_to_disk`
directory, written by the `datasets` package itself, give the same .bin/.idx as the same text as
jsonl, for any --workers; a batch at a time; a missing column or a non-string row named."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megazero.data.sources import read_documents
from tests.unit.test_preprocess_streaming import _files, _script, _text

pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def documents() -> list[str]:
    rng = np.random.default_rng(1)
    return [_text(rng, int(rng.integers(1, 15))) for _ in range(300)] + ["", "café — ½ ✓\n\nend"]


@pytest.fixture(scope="module")
def tokenizer(documents, tmp_path_factory) -> str:
    from megazero.data import train_sentencepiece

    root = tmp_path_factory.mktemp("tok")
    (root / "sample.txt").write_text("\n".join(documents))
    return train_sentencepiece([str(root / "sample.txt")], str(root / "tok"), 300)


def _preprocess(inputs: list[str], prefix: str, tokenizer: str, *flags: str) -> dict[str, bytes]:
    _script("preprocess_data")(["--input", *inputs, "--output-prefix", prefix, "--tokenizer-model", tokenizer,
                                "--log-interval", "1000", *flags])
    return {k: v for k, v in _files(prefix).items() if not k.endswith("_stats.json")}


def test_parquet_arrow_and_save_to_disk_equal_the_same_text_as_jsonl(documents, tokenizer, tmp_path):
    from datasets import Dataset

    half = len(documents) // 2
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(documents))
    expected = _preprocess([str(tmp_path / "docs.jsonl")], str(tmp_path / "jsonl" / "p"), tokenizer)
    assert expected

    table = Dataset.from_dict({"id": list(range(len(documents))), "text": documents})
    (tmp_path / "pq").mkdir()
    table.select(range(half)).to_parquet(str(tmp_path / "pq" / "a.parquet"))
    table.select(range(half, len(documents))).to_parquet(str(tmp_path / "pq" / "b.parquet"))
    parquet_files = [str(tmp_path / "pq" / "a.parquet"), str(tmp_path / "pq" / "b.parquet")]
    assert _preprocess(parquet_files, str(tmp_path / "out_pq" / "p"), tokenizer) == expected
    assert _preprocess([str(tmp_path / "pq")], str(tmp_path / "out_pq_dir" / "p"), tokenizer) == expected

    table.save_to_disk(str(tmp_path / "saved"), num_shards=3)  # datasets.load_from_disk's layout
    for workers in ("1", "2"):  # small chunks: many chunks in flight across the workers
        assert _preprocess([str(tmp_path / "saved")], str(tmp_path / f"out_saved{workers}" / "p"), tokenizer,
                           "--workers", workers, "--chunk-mb", "0.002") == expected
    arrow = sorted(f for f in os.listdir(tmp_path / "saved") if f.endswith(".arrow"))
    assert len(arrow) == 3
    assert _preprocess([str(tmp_path / "saved" / f) for f in arrow], str(tmp_path / "out_arrow" / "p"),
                       tokenizer) == expected
    with open(str(tmp_path / "out_saved1" / "p") + "_stats.json") as f:
        stats = json.load(f)
    assert stats["train"]["documents"] + stats["valid"]["documents"] == len(documents)


def test_another_column_a_missing_one_and_bad_rows(documents, tokenizer, tmp_path):
    from datasets import Dataset, DatasetDict

    Dataset.from_dict({"content": documents[:20]}).to_parquet(str(tmp_path / "c.parquet"))
    with open(tmp_path / "c.jsonl", "w") as f:
        f.writelines(json.dumps({"content": d}) + "\n" for d in documents[:20])
    flags = ("--json-key", "content")
    assert (_preprocess([str(tmp_path / "c.parquet")], str(tmp_path / "a" / "p"), tokenizer, *flags)
            == _preprocess([str(tmp_path / "c.jsonl")], str(tmp_path / "b" / "p"), tokenizer, *flags))
    with pytest.raises(SystemExit, match=r"c.parquet: no column 'text' \(columns: \['content'\]\); choose one with "
                                         r"--json-key"):
        _preprocess([str(tmp_path / "c.parquet")], str(tmp_path / "d" / "p"), tokenizer)

    Dataset.from_dict({"text": ["fine", None, "also fine", "x"]}).to_parquet(str(tmp_path / "none.parquet"))
    with pytest.raises(SystemExit, match="none.parquet: row 1: column 'text' is NoneType, expected a string"):
        _preprocess([str(tmp_path / "none.parquet")], str(tmp_path / "e" / "p"), tokenizer)
    _preprocess([str(tmp_path / "none.parquet")], str(tmp_path / "f" / "p"), tokenizer, "--skip-bad-lines")
    with open(str(tmp_path / "f" / "p") + "_stats.json") as f:
        assert json.load(f)["skipped_bad_lines"] == 1

    DatasetDict({"train": Dataset.from_dict({"text": documents[:4]}),
                 "test": Dataset.from_dict({"text": documents[4:8]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(SystemExit, match=r"dd is a DatasetDict with splits \['train', 'test'\]: give one split's "
                                         r"directory, e.g. .*dd/train"):
        _preprocess([str(tmp_path / "dd")], str(tmp_path / "g" / "p"), tokenizer)
    assert _preprocess([str(tmp_path / "dd" / "train")], str(tmp_path / "h" / "p"), tokenizer)
    (tmp_path / "junk.parquet").write_bytes(b"not a parquet file at all")
    with pytest.raises(SystemExit, match="junk.parquet: not a readable parquet table"):
        _preprocess([str(tmp_path / "junk.parquet")], str(tmp_path / "i" / "p"), tokenizer)


def test_a_table_is_read_a_batch_at_a_time(tmp_path):
    import pyarrow as pa
    from datasets import Dataset

    rows = 10000
    big = Dataset.from_dict({"text": [f"{i} " + "x" * 4000 for i in range(rows)]})  # 40 MB of text
    big.to_parquet(str(tmp_path / "big.parquet"), batch_size=500)  # row groups of 500 rows, 2 MB
    big.save_to_disk(str(tmp_path / "saved"))
    arrow = [str(tmp_path / "saved" / f) for f in os.listdir(tmp_path / "saved") if f.endswith(".arrow")]
    for path in (str(tmp_path / "big.parquet"), arrow[0]):
        before = pa.total_allocated_bytes()
        reader = read_documents(path)
        first = next(reader)
        assert first.text.startswith("0 ") and first.name == f"{path}:0"
        # one batch of 1,024 rows decoded (parquet), or none (arrow: memory-mapped), not the 40 MB table
        assert pa.total_allocated_bytes() - before < 12 << 20, path
        assert sum(1 for _ in reader) == rows - 1
