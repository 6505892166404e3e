"""Every name in a checkpoint directory (DeepSpeed's names, extended by pipeline stage), and the
format version the model files record.

    save_dir/latest                              the tag of the newest complete checkpoint
    save_dir/{tag}/                              one checkpoint:
      mp_rank_{TP}_model_states.pt               module state, counters, schedule, loss scale, layout
      mp_rank_{TP}_optim_states.pt               a replicated data-parallel state (ZeRO 0): optimizer
                                                 state and fp32 masters, written by DP rank 0
      zero_pp_rank_{DP}_mp_rank_{TP}_optim_states.pt   a partitioned one (ZeRO 1-3): DP rank DP's partitions
      rng_state_rank{R}.pt                       each global rank's RNG states
      optim_rank_state_rank{R}.pt                an optimizer's own per-rank state (the 1-bit
                                                 optimizers' compression errors), when it has one
      manifest.json                              every other file's size and checksum, and the layout:
                                                 written last, so a directory with one is complete
    save_dir/.{tag}.tmp/, save_dir/.{tag}.old/   a checkpoint being written, one being replaced
    FILE.tmp{PID}                                a file being written (renamed over FILE when complete)

With pipeline parallelism the model-parallel suffix {TP} becomes {TP}_{PP} (two and three digits),
so every (tensor rank, pipeline stage) has its own files and a single-process checkpoint keeps
DeepSpeed's mp_rank_00_* names.
"""

from __future__ import annotations

import glob
import os
import re

LATEST_FILE = "latest"
MANIFEST_FILE = "manifest.json"
MODEL_FILES = "mp_rank_*_model_states.pt"  # the glob pattern of every model file of a checkpoint
ZERO_FILES = "zero_pp_rank_*_optim_states.pt"  # ... and of every ZeRO partition file
# 2: the layout (TP, PP, DP, ZeRO stage) and per-parameter partition metadata in the model files;
# 1: single-process checkpoints from before model parallelism, still read (universal.saved_layout)
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)


def mp_suffix(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """The model-parallel part of a file name."""
    return f"{tp_rank:02d}" if pp_size == 1 else f"{tp_rank:02d}_{pp_rank:03d}"


def model_file(tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1) -> str:
    """Module state file of one (tensor rank, pipeline stage)."""
    return f"mp_rank_{mp_suffix(tp_rank, pp_rank, pp_size)}_model_states.pt"


def optim_file(tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1) -> str:
    """The state file of a replicated data-parallel state (ZeRO 0) of one (tensor rank, pipeline stage)."""
    return f"mp_rank_{mp_suffix(tp_rank, pp_rank, pp_size)}_optim_states.pt"


def zero_file(dp_rank: int, tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1) -> str:
    """The state file of one data-parallel rank of a partitioned state (ZeRO 1-3) of one (tensor rank,
    pipeline stage)."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_suffix(tp_rank, pp_rank, pp_size)}_optim_states.pt"


def rng_file(rank: int) -> str:
    """Name of the RNG-state file of global rank `rank`."""
    return f"rng_state_rank{rank}.pt"


def rank_state_file(rank: int) -> str:
    """Name of the per-rank optimizer state file of global rank `rank` (megazero.optim.protocol.RankLocalState)."""
    return f"optim_rank_state_rank{rank}.pt"


def model_files_in(path: str) -> list[str]:
    """Paths of every model file of the checkpoint directory `path`, sorted."""
    return sorted(glob.glob(os.path.join(path, MODEL_FILES)))


def writing_dir(save_dir: str, tag: str) -> str:
    """The directory a checkpoint is written in before it is published as save_dir/tag."""
    return os.path.join(save_dir, f".{tag}.tmp")


def replaced_dir(save_dir: str, tag: str) -> str:
    """Where a published save_dir/tag waits while a new checkpoint of the same tag replaces it."""
    return os.path.join(save_dir, f".{tag}.old")


def partial_file(path: str) -> str:
    """The name `path` is written under until it is complete (one per process)."""
    return f"{path}.tmp{os.getpid()}"


def zero_files_of(path: str, tp_rank: int, pp_rank: int, pp_size: int) -> dict[int, str]:
    """{data-parallel rank: file} of the ZeRO files of one (tensor rank, pipeline stage)."""
    suffix = mp_suffix(tp_rank, pp_rank, pp_size)
    pattern = re.compile(rf"zero_pp_rank_(\d+)_mp_rank_{suffix}_optim_states\.pt$")
    files = {}
    for f in glob.glob(os.path.join(path, ZERO_FILES)):
        match = pattern.search(f)
        if match:
            files[int(match.group(1))] = f
    return files
