"""Check a checkpoint offline against its manifest: every file present, at its size, with its checksum.

    python scripts/verify_checkpoint.py SAVE_DIR [--tag T]   # the tag `latest` names, or T
    python scripts/verify_checkpoint.py SAVE_DIR/TAG         # one checkpoint directory

Exit 0 when whole; otherwise exit 1 and print each bad file (missing, truncated, corrupt), or why the
directory or `latest` cannot be read.
"""

from __future__ import annotations

import argparse
import os
import sys

from megazero.checkpoint.engine_state import resolve_tag
from megazero.checkpoint.files import MANIFEST_FILE
from megazero.checkpoint.io import CheckpointError
from megazero.checkpoint.manifest import complete_tags, directory_problems, read_manifest


def main(argv: list[str] | None = None) -> int:
    """Verify one checkpoint; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="a save directory (with `latest`) or one checkpoint directory")
    parser.add_argument("--tag", default=None, help="the tag to check (default: the one `latest` names)")
    parser.add_argument("--sizes-only", action="store_true", help="skip the checksums")
    args = parser.parse_args(argv)
    if args.tag is None and os.path.isfile(os.path.join(args.dir, MANIFEST_FILE)):
        path = args.dir
    else:
        try:
            tag = resolve_tag(args.dir, args.tag)
        except CheckpointError as e:
            print(f"NOT WHOLE: {e}", file=sys.stderr)
            return 1
        if tag is None:
            print(f"NOT WHOLE: {args.dir}: no `latest` and no --tag", file=sys.stderr)
            return 1
        path = os.path.join(args.dir, tag)
    try:
        manifest = read_manifest(path)
    except ValueError as e:
        print(f"NOT WHOLE: {e}", file=sys.stderr)
        return 1
    if manifest is None:
        print(f"NOT WHOLE: {path}: no {MANIFEST_FILE} (written before manifests, or not a checkpoint)",
              file=sys.stderr)
        return 1
    problems = directory_problems(path, checksums=not args.sizes_only)
    for problem in problems:
        print(f"BAD: {problem}", file=sys.stderr)
    if problems:
        save_dir, tag = os.path.split(os.path.normpath(path))
        previous = complete_tags(save_dir, exclude=tag)
        if previous:
            print(f"the previous complete tag is {previous[-1]!r} (sizes checked; load it by tag, or with "
                  f"load_checkpoint(..., fallback=True); recipes: --load-fallback)", file=sys.stderr)
        return 1
    total = sum(entry["size"] for entry in manifest["files"].values())
    print(f"{path}: whole: {len(manifest['files'])} files, {total:,} bytes, {manifest['algorithm']} "
          f"{'not checked' if args.sizes_only else 'checked'}; layout {manifest.get('layout', {})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
