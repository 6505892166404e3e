"""Weighted blending of datasets (Megatron's `--data-path 0.7 P1 0.3 P2`).

The blend index says, for each of `size` samples, which dataset it comes from and which sample of
that dataset it is. Dataset d's k-th sample is due at (k + 1/2) / w_d and samples are taken in the
order they fall due (ties: the lower dataset first), so after any n samples dataset d has given
w_d * n of them, within one: Megatron's greedy "most behind its weight goes next" rule, vectorised.
Past `size` the blend repeats with each dataset continuing into its later samples (the datasets
are MultiEpochDatasets), so index i is a pure function of i: resuming at consumed_samples is exact.
The index is cached as .npy under the data directory, keyed by its inputs; rank 0 builds it while
the other ranks wait at a barrier, then every rank loads the same files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np
import torch.distributed as dist

from megazero.data.loader import MultiEpochDataset


def parse_data_path(values: list[str], flag: str = "--data-path",
                    unweighted: bool = False) -> tuple[list[float], list[str]]:
    """(normalised weights, prefixes) of `P` or `W1 P1 W2 P2 ...` given to `flag`; with
    `unweighted` also `P1 P2 ...` (equal weights: the valid and test sets, each reported apart)."""
    if len(values) == 1:
        return [1.0], list(values)
    if unweighted and not any(_is_number(v) for v in values):
        return [1 / len(values)] * len(values), list(values)
    pairs = "weight-prefix pairs (W1 P1 W2 P2 ...)" + (" or prefixes (P1 P2 ...)" if unweighted else "")
    if len(values) % 2:
        raise ValueError(f"{flag} takes one prefix or {pairs}, got {values}")
    try:
        weights = [float(w) for w in values[0::2]]
    except ValueError:
        raise ValueError(f"{flag} takes one prefix or {pairs}: {values[0::2]} are not all numbers") from None
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"{flag} weights must be positive, got {weights}")
    return [w / sum(weights) for w in weights], list(values[1::2])


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def build_blend_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset index uint8/int16, sample index int64 within that dataset) of `size` blended samples."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    per = [int(math.ceil(x * size)) + 1 for x in w]  # candidates per dataset: more than it can be given
    due = np.concatenate([(np.arange(n, dtype=np.float64) + 0.5) / x for n, x in zip(per, w)])
    order = np.argsort(due, kind="stable")[:size]  # stable: equal due times keep the dataset order
    starts = np.cumsum([0] + per)
    dataset = (np.searchsorted(starts, order, side="right") - 1).astype(np.uint8 if len(w) < 256 else np.int16)
    return dataset, (order - starts[dataset]).astype(np.int64)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def load_or_build(weights: list[float], size: int, cache_dir: str | None, description: dict
                  ) -> tuple[np.ndarray, np.ndarray, str]:
    """The blend index from cache_dir (built there once by rank 0 first, the other ranks waiting);
    returns (dataset index, sample index, cache key). Without cache_dir every rank builds it."""
    key = hashlib.sha256(json.dumps({**description, "weights": weights, "size": size},
                                    sort_keys=True).encode()).hexdigest()[:16]
    if cache_dir is None:
        return *build_blend_indices(weights, size), key
    base = os.path.join(cache_dir, f"blend_{key}")
    rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if rank0 and not os.path.isfile(base + "_sample_index.npy"):
        os.makedirs(cache_dir, exist_ok=True)
        dataset, sample = build_blend_indices(weights, size)
        for name, array in (("dataset_index", dataset), ("sample_index", sample)):
            np.save(f"{base}_{name}.tmp.npy", array)
            os.replace(f"{base}_{name}.tmp.npy", f"{base}_{name}.npy")  # sample_index last: the "done" mark
        with open(base + "_description.json", "w") as f:
            json.dump({**description, "weights": weights, "size": size}, f, indent=1)
    _barrier()
    return np.load(base + "_dataset_index.npy"), np.load(base + "_sample_index.npy"), key


class BlendedDataset(MultiEpochDataset):
    """Sample i of the blend of `datasets` (MultiEpochDatasets) with `weights`: dataset
    dataset_index[i % size], its sample sample_index[i % size] + (i // size) * (its samples per block)."""

    def __init__(self, datasets: list, weights: list[float], size: int, cache_dir: str | None = None,
                 description: dict | None = None):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if size < 1:
            raise ValueError(f"a blend needs at least 1 sample, got size {size}")
        self.datasets, self.weights, self.size = datasets, list(weights), size
        self.dataset_index, self.sample_index, self.key = load_or_build(self.weights, size, cache_dir,
                                                                        description or {})
        self.per_block = np.bincount(self.dataset_index, minlength=len(datasets)).astype(np.int64)

    def __len__(self) -> int:
        """Samples in one block of the blend (it repeats past this)."""
        return self.size

    def source(self, index: int) -> tuple[int, int]:
        """(dataset, its sample) that blended sample `index` reads."""
        block, position = divmod(index, self.size)
        d = int(self.dataset_index[position])
        return d, int(self.sample_index[position]) + block * int(self.per_block[d])

    def __getitem__(self, index: int):
        d, sample = self.source(index)
        return self.datasets[d][sample]
