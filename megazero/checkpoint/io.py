"""Atomic checkpoint files and directories, and the `latest` pointer.

A checkpoint directory is written under a temporary name, renamed into place only once every
rank has finished writing, and `latest` is replaced last; a save killed at any moment leaves the
previous checkpoint, and `latest`, intact. Files hold tensors and plain Python values only and are
read with `torch.load(..., weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil

import torch
import torch.distributed as dist

LATEST_FILE = "latest"
_TAG_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]+$")
_PLAIN = (str, int, float, bool, type(None), torch.Tensor)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or holds something it must not."""


def check_plain(value, where: str = "client_state") -> None:
    """Raise CheckpointError unless `value` is tensors and plain values in dicts/lists/tuples."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise CheckpointError(f"{where}: key {key!r} must be str or int")
            check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN):
        raise CheckpointError(f"{where} holds a {type(value).__name__}; checkpoints may hold only tensors and "
                              f"plain values (str, int, float, bool, None, lists, tuples, dicts)")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_file(obj, path: str) -> None:
    """torch.save to a temporary name in the same directory, fsync, then rename over `path`."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_file(path: str):
    """torch.load with weights_only=True; a missing or unreadable file raises CheckpointError naming it."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, or a pickled object we refuse to load
        raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from e


def write_text_atomic(path: str, text: str) -> None:
    """Replace a small text file atomically."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_latest(load_dir: str) -> str | None:
    """The tag named by load_dir/latest, or None when there is none."""
    path = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    return tag or None


def check_tag(tag: str) -> str:
    """A tag is one path component of letters, digits, '_', '-', '.'."""
    if not _TAG_PATTERN.match(tag) or tag in (".", "..", LATEST_FILE):
        raise CheckpointError(f"invalid checkpoint tag {tag!r}: use letters, digits, '_', '-' and '.'")
    return tag


def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


@contextlib.contextmanager
def atomic_checkpoint_dir(save_dir: str, tag: str, group=None):
    """Yield a temporary directory for all ranks to fill; on success publish it as save_dir/tag.

    Collective over `group` (default: the world). Rank 0 of the group renames and updates `latest`.
    """
    check_tag(tag)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    final = os.path.join(save_dir, tag)
    tmp = os.path.join(save_dir, f".{tag}.tmp")
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a killed save of the same tag
        os.makedirs(tmp)
    _barrier(group)
    yield tmp
    _barrier(group)  # every rank's files are complete
    if rank == 0:
        old = os.path.join(save_dir, f".{tag}.old")
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(final):
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(save_dir)
        write_text_atomic(os.path.join(save_dir, LATEST_FILE), tag)
        _fsync_dir(save_dir)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(group)
