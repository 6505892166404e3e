"""Blending (issue 20): proportions, the cached index, --split by documents, the data flags."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

from megazero.config.run import DataSection
from megazero.data import GPTDataset, IndexedDataset, write_indexed_dataset
from megazero.data.blended_dataset import BlendedDataset, build_blend_indices, parse_data_path
from megazero.data.data_paths import build_splits
from megazero.data.indexed_dataset import DocumentRange, split_documents


def test_blend_proportions_follow_the_weights():
    """Over 100k samples each dataset's share is within 1% of its weight, and within one sample of
    it after every prefix; the index is a pure function of the weights."""
    weights = [0.5, 0.3, 0.2]
    dataset, sample = build_blend_indices(weights, 100_000)
    counts = np.bincount(dataset, minlength=3)
    assert np.all(np.abs(counts / 100_000 - weights) < 0.01), counts
    running = np.cumsum(np.eye(3, dtype=np.int64)[dataset], axis=0)
    expected = np.outer(np.arange(1, 100_001), weights)
    assert np.abs(running - expected).max() <= 1.0
    for d in range(3):  # each dataset's samples are taken in order, none twice
        assert np.array_equal(sample[dataset == d], np.arange(counts[d]))
    again = build_blend_indices(weights, 100_000)
    assert np.array_equal(again[0], dataset) and np.array_equal(again[1], sample)


def test_parse_data_path():
    assert parse_data_path(["data/p"]) == ([1.0], ["data/p"])
    assert parse_data_path(["7", "a", "3", "b"]) == ([0.7, 0.3], ["a", "b"])
    with pytest.raises(ValueError, match="weight-prefix pairs"):
        parse_data_path(["a", "b"])
    with pytest.raises(ValueError, match="positive"):
        parse_data_path(["0.5", "a", "0", "b"])


def test_split_by_documents_as_megatron():
    assert split_documents("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_documents("98,2", 40) == [(0, 39), (39, 40), (40, 40)]
    with pytest.raises(ValueError, match="--split"):
        split_documents("a,b", 10)


def _family(prefix: str, docs: int, offset: int) -> None:
    """A train/valid pair whose tokens say which dataset (and document) they come from."""
    rng = np.random.default_rng(offset)
    for split, n in (("train", docs), ("valid", 4)):
        write_indexed_dataset(f"{prefix}_{split}_text_document",
                              [np.full(int(rng.integers(20, 60)), offset + i % 10, np.uint16) for i in range(n)],
                              np.uint16)


def test_blended_data_path_builds_a_cached_blend_and_per_dataset_validation(tmp_path):
    """--data-path 0.7 A 0.3 B: the train blend draws 70/30 from the two train sets (cached under
    the data directory, loaded again the same), and each valid set is kept by name; a one-dataset
    prefix is cut by --split into train/valid/test documents."""
    a, b = str(tmp_path / "web"), str(tmp_path / "books")
    _family(a, 50, 0)
    _family(b, 30, 100)
    args = DataSection(data_path=["0.7", a, "0.3", b]).checked()
    make = lambda indexed, split: GPTDataset(indexed, 8, seed=1, shuffle=split == "train")  # noqa: E731
    data = build_splits(args, "document", make, 1000, {"seed": 1})
    assert isinstance(data.train, BlendedDataset) and sorted(data.valid) == ["books", "web"]
    assert data.valid_weights == pytest.approx({"web": 0.7, "books": 0.3})
    from_b = sum(int(data.train[i]["input_ids"][0]) >= 100 for i in range(1000))
    assert 290 <= from_b <= 310
    cached = sorted(os.listdir(tmp_path / "blend_cache"))
    assert len(cached) == 3 and all(name.startswith(f"blend_{data.blend_key}") for name in cached)
    again = build_splits(args, "document", make, 1000, {"seed": 1})
    assert again.blend_key == data.blend_key and np.array_equal(again.train.dataset_index, data.train.dataset_index)
    assert build_splits(args, "document", make, 1000, {"seed": 2}).blend_key != data.blend_key
    # past its block the blend continues into the datasets' later samples
    d, sample = data.train.source(1000 + 5)
    assert d == data.train.source(5)[0] and sample == data.train.source(5)[1] + data.train.per_block[d]

    write_indexed_dataset(str(tmp_path / "one"), [np.full(10, i, np.uint16) for i in range(100)], np.uint16)
    args = DataSection(data_path=[str(tmp_path / "one")], split="8,1,1").checked()
    data = build_splits(args, "document", lambda indexed, split: indexed, 10)
    assert [(x.first, x.end) for x in (data.train, data.valid["one"], data.test["one"])] == \
        [(0, 80), (80, 90), (90, 100)]
    assert data.valid["one"][0][0] == 80 and data.test["one"].num_tokens == 100
    whole = IndexedDataset(str(tmp_path / "one"))
    assert np.array_equal(DocumentRange(whole, 80, 90).tokens, whole.tokens[800:900])


def test_data_flags_name_themselves_and_an_empty_split_is_reported(tmp_path, capsys):
    """Plain prefixes for --valid-data-path are each reported apart (equal weights); a malformed
    list is a usage error naming the flag it was given to; a --split share that rounds to no
    document is printed and warned about instead of the test set vanishing."""
    assert parse_data_path(["a", "b"], "--valid-data-path", unweighted=True) == ([0.5, 0.5], ["a", "b"])
    with pytest.raises(ValueError, match="--train-data-path takes one prefix or weight-prefix pairs"):
        parse_data_path(["a", "b"], "--train-data-path")
    with pytest.raises(ValueError, match="--valid-data-path takes one prefix or weight-prefix pairs"):
        DataSection(train_data_path=["a"], valid_data_path=["0.5", "b", "c"]).checked()

    write_indexed_dataset(str(tmp_path / "few"), [np.full(10, i, np.uint16) for i in range(40)], np.uint16)
    args = DataSection(data_path=[str(tmp_path / "few")], split="969,30,1").checked()
    with pytest.warns(UserWarning, match="gives .*few's test part no document of its 40"):
        data = build_splits(args, "document", lambda indexed, split: indexed, 10)
    assert "few: 40 documents, --split 969,30,1: train 39, valid 1, test 0" in capsys.readouterr().out
    assert not data.test


def test_launchers_take_a_blend_in_data_path_and_leave_named_data_alone():
    lib = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts",
                       "launch_lib.bash")

    def data_args(data_path: str | None, *flags: str) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k != "DATA_PATH"}
        if data_path is not None:
            env["DATA_PATH"] = data_path
        script = f'source {lib}; megazero_data_args data/default "$@"; printf "%s\\n" "${{DATA_ARGS[@]}}"'
        proc = subprocess.run(["bash", "-c", script, "bash", *flags], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    assert data_args(None) == ["--data-path", "data/default"]
    assert data_args("0.7 data/web 0.3 data/books") == ["--data-path", "0.7", "data/web", "0.3", "data/books"]
    assert data_args("0.7 data/web 0.3 data/books", "--train-data-path", "A", "--valid-data-path", "B") == []
    assert data_args(None, "--lr", "1", "--data-path", "X") == []
