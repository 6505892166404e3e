"""Atomic checkpoint files and directories, and the `latest` pointer.

A checkpoint directory is written under a temporary name, renamed into place only once every
rank has finished writing, and `latest` is replaced last; a save killed at any moment leaves the
previous checkpoint, and `latest`, intact. Files hold tensors and plain Python values only and are
read with `torch.load(..., weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings

import torch
import torch.distributed as dist

from megazero.watchdog import watched

LATEST_FILE = "latest"
_SEPARATORS = tuple(sep for sep in (os.sep, os.altsep, "\0", "\n", "\r") if sep)
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


def save_tensors(state: dict, path: str) -> None:
    """Write a {name: tensor} dict atomically (temporary name, fsync, rename): safetensors when `path`
    ends in .safetensors (tied entries stored once per name), else torch.save."""
    if not path.endswith(".safetensors"):
        save_file(state, path)
        return
    from safetensors.torch import save_file as save_safetensors

    seen, tensors = set(), {}
    for name, tensor in state.items():  # safetensors refuses two names over one storage
        tensors[name] = tensor.clone() if id(tensor) in seen else tensor.contiguous()
        seen.add(id(tensor))
    tmp = f"{path}.tmp{os.getpid()}"
    save_safetensors(tensors, tmp, metadata={"format": "pt"})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def check_tag(tag) -> str:
    """str(tag) (DeepSpeed accepts any tag str() prints, e.g. a float loss), checked to name one
    directory of save_dir that `latest` can hold: no path separator or line break, no leading '.'
    (the temporary names) or surrounding spaces, not 'latest'."""
    text = str(tag)
    if (not text or any(sep in text for sep in _SEPARATORS) or text.startswith(".") or text != text.strip()
            or text == LATEST_FILE):
        raise CheckpointError(f"invalid checkpoint tag {text!r}: a tag names one directory: no '/', no line "
                              f"break, no leading '.' or surrounding spaces, and not '{LATEST_FILE}'")
    return text


def agree_on_tag(tag, validation: str = "WARN", group=None):
    """Collective: every rank gets rank 0's tag (str(tag), or None). Ranks whose tag differs from
    rank 0's are named in a warning on rank 0 (validation 'WARN'), in an error on every rank
    ('FAIL'), or not at all ('IGNORE'): DeepSpeed's checkpoint.tag_validation."""
    tag = None if tag is None else str(tag)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tag
    tags = [None] * dist.get_world_size(group)
    dist.all_gather_object(tags, tag, group=group)
    differing = [rank for rank, other in enumerate(tags) if other != tags[0]]
    if differing and validation != "IGNORE":
        shown = ", ".join(f"rank {rank} {tags[rank]!r}" for rank in differing[:8])
        more = f" and {len(differing) - 8} more" if len(differing) > 8 else ""
        message = (f"checkpoint tag differs across ranks: rank 0 has {tags[0]!r}, {shown}{more} (checkpoint."
                   f"tag_validation is {validation.capitalize()})")
        if validation == "FAIL":
            raise CheckpointError(message)
        if dist.get_rank(group) == 0:
            warnings.warn(message + f"; every rank uses rank 0's tag {tags[0]!r}", stacklevel=3)
    return tags[0]


@watched("barrier (checkpoint save)")
def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _check_every_rank_sees(tmp: str, group) -> None:
    """Collective, after rank 0 made `tmp`: raise on every rank, naming the ranks, when some rank
    cannot see it (another save_dir on that rank, or a file system the nodes do not share)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    _barrier(group)  # rank 0 has made it
    seen = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, (os.path.isdir(tmp), os.path.abspath(tmp)), group=group)
    blind = [rank for rank, (ok, _) in enumerate(seen) if not ok]
    if blind:
        looked = ", ".join(f"rank {rank} looked for {seen[rank][1]}" for rank in blind[:4])
        raise CheckpointError(f"ranks {blind} cannot see the checkpoint directory {seen[0][1]} that rank 0 made "
                              f"({looked}): every rank must pass the same save_dir, on a file system all ranks share")


@contextlib.contextmanager
def atomic_checkpoint_dir(save_dir: str, tag: str, group=None):
    """Yield a temporary directory for all ranks to fill; on success publish it as save_dir/tag.

    Collective over `group` (default: the world). Rank 0 of the group renames and updates `latest`.
    """
    tag = check_tag(tag)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    final = os.path.join(save_dir, tag)
    tmp = os.path.join(save_dir, f".{tag}.tmp")
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a killed save of the same tag
        os.makedirs(tmp)
    _check_every_rank_sees(tmp, group)
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
