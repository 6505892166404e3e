"""Atomic checkpoint files and directories, and the `latest` pointer.

A checkpoint directory is written under a temporary name, renamed into place only once every
rank has finished writing, and `latest` is replaced last; a save killed at any moment leaves the
previous checkpoint, and `latest`, intact. A save that fails on any rank (a full disk: ENOSPC,
EFBIG) publishes nothing, removes its temporary directory and raises on every rank, naming the file
and the errno: the ranks agree on success before the rename. The directory's manifest (checksums
taken while the files are written, and the layout) is written last, inside the rename. Files hold
tensors and plain Python values only and are read with `torch.load(..., weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import signal
import warnings

import torch
import torch.distributed as dist

from megazero.checkpoint.files import (
    FORMAT_VERSION,
    LATEST_FILE,
    MANIFEST_FILE,
    READABLE_FORMAT_VERSIONS,
    partial_file,
    replaced_dir,
    writing_dir,
)
from megazero.checkpoint.manifest import ChecksumWriter, build_manifest, complete_tags, file_entry
from megazero.watchdog import watched

# fault injection for the tests (tests/faults): SIGKILL this process at the named point of a save
FAULT_ENV = "MEGAZERO_CHECKPOINT_FAULT"
# "0": replace a re-saved tag with two renames instead of one atomic exchange (renameat2), as on
# file systems without RENAME_EXCHANGE; loading then restores the replaced directory if needed
EXCHANGE_ENV = "MEGAZERO_CHECKPOINT_RENAME_EXCHANGE"
_RENAME_EXCHANGE, _AT_FDCWD = 2, -100
_written: dict[str, dict[str, dict]] = {}  # open atomic directory -> {file name: manifest entry}

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


def check_format_version(state: dict, path: str) -> None:
    """Raise CheckpointError naming the file unless its format_version is one this code reads."""
    version = state.get("format_version")
    if version not in READABLE_FORMAT_VERSIONS:
        raise CheckpointError(f"{path}: format_version {version!r}, expected {FORMAT_VERSION} (this megazero reads "
                              f"versions {', '.join(map(str, READABLE_FORMAT_VERSIONS))})")


def describe_os_error(error: BaseException) -> str:
    """'[Errno 28] ENOSPC: No space left on device' for an OSError, else str(error)."""
    if isinstance(error, OSError) and error.errno is not None:
        return f"[Errno {error.errno}] {errno.errorcode.get(error.errno, '?')}: {error.strerror}"
    return str(error)


def _record(path: str, entry: dict) -> None:
    """Note a complete file for the manifest of the atomic directory it was written in (if any)."""
    files = _written.get(os.path.abspath(os.path.dirname(path)))
    if files is not None:
        files[os.path.basename(path)] = entry


@contextlib.contextmanager
def _writing(path: str):
    """Around writing `path` via its partial name: on any failure remove the partial file and raise
    CheckpointError naming `path` and the errno."""
    tmp = partial_file(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except Exception as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise CheckpointError(f"cannot write checkpoint file {path}: {describe_os_error(e)}") from e


def save_file(obj, path: str) -> None:
    """torch.save to a temporary name in the same directory, fsync, then rename over `path`; a failed
    write (full disk) removes the partial file and raises CheckpointError naming `path` and the errno."""
    writer = None
    with _writing(path) as tmp, open(tmp, "wb") as f:
        writer = ChecksumWriter(f)
        try:
            torch.save(obj, writer)
            f.flush()
            os.fsync(f.fileno())
        except Exception as e:
            if writer.error is not None:  # torch.save reports a failed write without its errno
                raise writer.error from e
            raise
    _record(path, writer.checksum.entry())


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
    with _writing(path) as tmp:
        save_safetensors(tensors, tmp, metadata={"format": "pt"})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    _record(path, file_entry(path))


def write_text_atomic(path: str, text: str) -> None:
    """Replace a small text file atomically (CheckpointError naming it and the errno on failure)."""
    with _writing(path) as tmp, open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_latest(load_dir: str) -> str | None:
    """The tag named by load_dir/latest, or None when there is none."""
    path = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            tag = f.read().strip()
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not a tag ({e})") from e
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


def _check_every_rank_sees(tmp: str, group, made_error: str | None = None) -> None:
    """Collective, after rank 0 made `tmp` (or failed to: `made_error`): raise on every rank, naming the
    ranks, when some rank cannot see it (another save_dir on that rank, or a file system the nodes do
    not share)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if made_error is not None:
            raise CheckpointError(made_error)
        return
    _barrier(group)  # rank 0 has made it
    seen = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, (os.path.isdir(tmp), os.path.abspath(tmp), made_error), group=group)
    if seen[0][2] is not None:
        raise CheckpointError(f"rank 0: {seen[0][2]}")
    blind = [rank for rank, (ok, _, _) in enumerate(seen) if not ok]
    if blind:
        looked = ", ".join(f"rank {rank} looked for {seen[rank][1]}" for rank in blind[:4])
        raise CheckpointError(f"ranks {blind} cannot see the checkpoint directory {seen[0][1]} that rank 0 made "
                              f"({looked}): every rank must pass the same save_dir, on a file system all ranks share")


def fault_point(name: str) -> None:
    """SIGKILL this process here when the environment's MEGAZERO_CHECKPOINT_FAULT names this point
    (fault injection for tests/faults; a kill -9 at the worst moment, for real)."""
    if os.environ.get(FAULT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _exchange(a: str, b: str) -> bool:
    """Swap two directories in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where the
    system or file system cannot (the caller then renames twice)."""
    if os.environ.get(EXCHANGE_ENV) == "0":
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(code, os.strerror(code), a)


@watched("all-gather (checkpoint save: did every rank write its files)")
def _gather(value, group) -> list:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [value]
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


@watched("broadcast (checkpoint save: rank 0 published)")
def _broadcast_from_first(value, group):
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    return box[0]


def _publish(save_dir: str, tag: str, tmp: str, manifest: dict) -> None:
    """Rank 0: write the manifest last, put tmp in place as save_dir/tag (the directory at that name is
    complete at every moment where renameat2 can exchange them), then update `latest`."""
    final, old = os.path.join(save_dir, tag), replaced_dir(save_dir, tag)
    write_text_atomic(os.path.join(tmp, MANIFEST_FILE), json.dumps(manifest, indent=1) + "\n")
    _fsync_dir(tmp)
    replaced = None
    try:
        if not os.path.exists(final):
            os.replace(tmp, final)
        elif _exchange(tmp, final):  # final is now the new checkpoint, tmp the replaced one
            replaced = tmp
            fault_point("between_renames")
        else:  # a kill between these two renames: loading restores `old` (resolve_tag)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            replaced = old
            fault_point("between_renames")
            os.replace(tmp, final)
        _fsync_dir(save_dir)
        write_text_atomic(os.path.join(save_dir, LATEST_FILE), tag)
        _fsync_dir(save_dir)
    except BaseException:
        if replaced == old and not os.path.isdir(final) and os.path.isdir(old):
            os.replace(old, final)  # the second rename failed: put the previous checkpoint back
        raise
    finally:
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)


def remove_old_tags(save_dir: str, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` complete tags (those with a manifest, by its saved_at),
    never the one `latest` names; returns the deleted tags. 0 keeps all."""
    if keep_last <= 0:
        return []
    tags = complete_tags(save_dir)
    named = read_latest(save_dir)
    doomed = [tag for tag in tags[:-keep_last] if tag != named]
    for tag in doomed:
        shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)
    return doomed


@contextlib.contextmanager
def atomic_checkpoint_dir(save_dir: str, tag: str, group=None, layout: dict | None = None, keep_last: int = 0):
    """Yield a temporary directory for all ranks to fill; on success publish it as save_dir/tag.

    Collective over `group` (default: the world). The ranks agree on success first: if any rank's
    block raised (a full disk), nothing is published, the temporary directory is removed, and every
    rank raises CheckpointError naming each failed rank's error. Rank 0 then writes the manifest
    (files written with save_file are checksummed as they are written; `layout` is recorded), renames,
    updates `latest`, and keeps the newest `keep_last` complete tags (0: all).
    """
    tag = check_tag(tag)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    final = os.path.join(save_dir, tag)
    tmp = writing_dir(save_dir, tag)
    made_error = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a killed save of the same tag
            os.makedirs(tmp)
        except OSError as e:  # a full disk: the other ranks must hear of it, not wait
            made_error = f"cannot create the checkpoint directory {tmp}: {describe_os_error(e)}"
    _check_every_rank_sees(tmp, group, made_error)
    key = os.path.abspath(tmp)
    _written[key] = {}
    error = None
    try:
        yield tmp
    except Exception as e:  # every rank must still reach the agreement below
        error = e
    finally:
        recorded = _written.pop(key, {})
    outcomes = _gather((None if error is None else describe_os_error(error), recorded), group)
    failed = [f"rank {r}: {message}" for r, (message, _) in enumerate(outcomes) if message is not None]
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier(group)  # every rank agreed on the failure: none raises before the directory is gone
        raise CheckpointError(f"checkpoint save of {final} failed, nothing published (the previous checkpoint and "
                              f"'{LATEST_FILE}' are unchanged): " + "; ".join(failed)) from error
    message = None
    if rank == 0:
        try:
            files = {name: entry for _, written in outcomes for name, entry in written.items()}
            _publish(save_dir, tag, tmp, build_manifest(tmp, files, tag, layout))
            remove_old_tags(save_dir, keep_last)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            message = f"rank 0: {describe_os_error(e)}"
    message = _broadcast_from_first(message, group)  # instead of a barrier: rank 0's outcome, on every rank
    if message is not None:
        raise CheckpointError(f"checkpoint save of {final} failed while publishing it: {message}")
