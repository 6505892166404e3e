"""The manifest of a checkpoint directory: every file's size and checksum, and the layout that
wrote it. It is written last, inside the atomic rename, so a directory holding one is complete,
and what it lists proves each file whole (checkpoint.verify, scripts/verify_checkpoint.py)."""

from __future__ import annotations

import json
import os
import time
import zlib

from megazero.checkpoint.files import FORMAT_VERSION, LATEST_FILE, MANIFEST_FILE

try:  # hardware crc32c when the package is there; zlib's crc32 (also fast) otherwise
    import crc32c as _crc32c
except ImportError:
    _crc32c = None

_CHUNK = 16 << 20
_UPDATE = {"crc32": zlib.crc32}
if _crc32c is not None:
    _UPDATE["crc32c"] = _crc32c.crc32c
ALGORITHM = "crc32c" if _crc32c is not None else "crc32"


class Checksum:
    """A running checksum (ALGORITHM unless named) of the bytes fed to update()."""

    def __init__(self, algorithm: str = ALGORITHM):
        if algorithm not in _UPDATE:
            raise ValueError(f"checksum {algorithm!r} is not available here (have {sorted(_UPDATE)}; crc32c needs "
                             f"`pip install crc32c`)")
        self.algorithm, self._update, self.value, self.size = algorithm, _UPDATE[algorithm], 0, 0

    def update(self, data) -> None:
        """Add `data` (bytes-like) to the checksum."""
        self.value = self._update(data, self.value)
        self.size += len(memoryview(data).cast("B"))

    def entry(self) -> dict:
        """The manifest entry of the bytes seen: {"size": n, "checksum": hex}."""
        return {"size": self.size, "checksum": f"{self.value:08x}"}


class ChecksumWriter:
    """A write-only file object over `f` that checksums what passes through and keeps the OSError a
    write raised (torch.save reports a failed write as a RuntimeError without the errno)."""

    def __init__(self, f):
        self.f, self.checksum, self.error = f, Checksum(), None

    def write(self, data) -> int:
        """Write `data` to the file, adding it to the checksum."""
        try:
            written = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.checksum.update(data)
        return written

    def flush(self) -> None:
        """Flush the underlying file."""
        self.f.flush()


def file_entry(path: str, algorithm: str = ALGORITHM) -> dict:
    """{"size", "checksum"} of a file on disk, read in chunks."""
    checksum = Checksum(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            checksum.update(chunk)
    return checksum.entry()


def build_manifest(directory: str, recorded: dict[str, dict], tag: str, layout: dict | None) -> dict:
    """The manifest of `directory`: `recorded` {name: entry} (checksummed while written), plus an entry
    read back from disk for every other file in it."""
    files = dict(recorded)
    for root, _, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel != MANIFEST_FILE and rel not in files:
                files[rel] = file_entry(os.path.join(directory, rel))
    return {"format_version": FORMAT_VERSION, "tag": tag, "saved_at": time.time(), "algorithm": ALGORITHM,
            "layout": layout or {}, "files": dict(sorted(files.items()))}


def read_manifest(directory: str) -> dict | None:
    """The manifest of a checkpoint directory; None when it has none (written before manifests).
    ValueError naming the file when it is not a manifest."""
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        if not isinstance(manifest.get("files"), dict):
            raise ValueError("no 'files' table")
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"{path}: not a checkpoint manifest ({e})") from e
    return manifest


def check_files(directory: str, manifest: dict, checksums: bool, names=None) -> list[str]:
    """Problems (each naming its file) of the files `manifest` lists: missing or of another size, and
    when `checksums`, another checksum (only the files in `names`, when given)."""
    problems = []
    algorithm = manifest.get("algorithm", ALGORITHM)
    for name, entry in manifest["files"].items():
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            problems.append(f"{path}: missing (the manifest lists {entry['size']} bytes)")
            continue
        size = os.path.getsize(path)
        if size != entry["size"]:
            problems.append(f"{path}: {size} bytes, the manifest says {entry['size']}")
        elif checksums and (names is None or name in names):
            try:
                got = file_entry(path, algorithm)["checksum"]
            except ValueError as e:
                problems.append(f"{path}: {e}")
                continue
            if got != entry["checksum"]:
                problems.append(f"{path}: {algorithm} {got}, the manifest says {entry['checksum']} (the file is "
                                f"corrupt)")
    return problems


def directory_problems(directory: str, checksums: bool = False) -> list[str]:
    """Why `directory` is not a whole checkpoint ([] when it is; a directory without a manifest, from
    before manifests, is taken as whole)."""
    if not os.path.isdir(directory):
        return [f"{directory}: no such checkpoint directory"]
    try:
        manifest = read_manifest(directory)
    except ValueError as e:
        return [str(e)]
    return [] if manifest is None else check_files(directory, manifest, checksums)


def complete_tags(save_dir: str, exclude: str | None = None) -> list[str]:
    """The tags of save_dir whose directory has a manifest and every listed file at its size, oldest
    first (by the manifest's saved_at)."""
    found = []
    for tag in os.listdir(save_dir) if os.path.isdir(save_dir) else []:
        path = os.path.join(save_dir, tag)
        if tag.startswith(".") or tag == LATEST_FILE or tag == exclude or not os.path.isdir(path):
            continue
        try:
            manifest = read_manifest(path)
        except ValueError:
            continue
        if manifest is not None and not check_files(path, manifest, checksums=False):
            found.append((float(manifest.get("saved_at", 0.0)), tag))
    return [tag for _, tag in sorted(found)]
