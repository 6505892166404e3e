"""Read and write bandwidth of megazero's async I/O op next to `dd` with direct I/O and next to
torch.save/torch.load, on one file system, in one run (alternating trials, median).

Rows (one file of --size-mb, default 1 GiB, in --dir, default data/aio_bench/ on the local disk):
  aio op               AsyncIO (C++ op): an aligned tensor, O_DIRECT, block 1 MiB / queue depth 8 /
                       1 thread (DeepSpeed's defaults), and block 4 MiB / 4 threads
  aio python fallback  AsyncIO(use_op=False): buffered os.pwrite/os.pread on threads
  dd direct            dd bs=4M oflag=direct (write, from /dev/zero) / iflag=direct (read, to /dev/null)
  torch.save/load      torch.save(tensor, path) / torch.load(path, weights_only=True)
The page cache is kept out of every number: direct I/O bypasses it, and the buffered rows' writes
are timed up to their fsync, and their file is evicted from the page cache (fsync +
posix_fadvise(DONTNEED)) before each timed read. Each write goes to a new file. Prints a table and
writes benchmarks/results/aio.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.record import write_result
from megazero.ops.aio import AsyncIO, aio_op, aligned_empty

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
PAGE_CACHE_NOTE = ("page cache excluded: O_DIRECT for the op and dd; buffered writes timed through fsync, "
                   "buffered reads after fsync + posix_fadvise(DONTNEED) of the file")


def evict(path: str) -> None:
    """Write the file's dirty pages back and drop its cached pages (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)


class AioRow:
    """AsyncIO with given options: write the tensor, read it back into a second aligned tensor."""

    def __init__(self, tensor: torch.Tensor, back: torch.Tensor, path: str, buffered: bool, **options):
        self.io = AsyncIO(**options)
        self.tensor, self.back, self.path, self.buffered = tensor, back, path, buffered

    def write(self) -> float:
        remove(self.path)
        start = time.perf_counter()
        self.io.write(self.tensor, self.path)
        if self.buffered:
            fsync(self.path)
        return time.perf_counter() - start

    def read(self) -> float:
        if self.buffered:
            evict(self.path)
        self.back.zero_()  # the buffer is shared: what the previous row read must not pass this row's check
        start = time.perf_counter()
        self.io.read(self.back, self.path)
        return time.perf_counter() - start

    def check(self) -> None:
        if not torch.equal(self.back, self.tensor):
            raise AssertionError(f"{self.path}: read back differs from what was written")


class DdRow:
    """dd with 4 MiB blocks and direct I/O, timed around the process."""

    def __init__(self, nbytes: int, path: str):
        self.count, self.path = nbytes // (4 * MiB), path

    def _run(self, *args: str) -> float:
        start = time.perf_counter()
        run = subprocess.run(["dd", "bs=4M", f"count={self.count}", *args], capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if run.returncode:
            raise RuntimeError(f"dd {' '.join(args)} failed: {run.stderr.strip()}")
        return seconds

    def write(self) -> float:
        remove(self.path)
        return self._run("if=/dev/zero", f"of={self.path}", "oflag=direct")

    def read(self) -> float:
        return self._run(f"if={self.path}", "of=/dev/null", "iflag=direct")

    def check(self) -> None:
        pass


class TorchRow:
    """torch.save through fsync, torch.load from a cold file."""

    def __init__(self, tensor: torch.Tensor, path: str):
        self.tensor, self.path = tensor, path
        self.loaded = None

    def write(self) -> float:
        remove(self.path)
        start = time.perf_counter()
        torch.save(self.tensor, self.path)
        fsync(self.path)
        return time.perf_counter() - start

    def read(self) -> float:
        self.loaded = None  # the previous load's memory is freed before this one is timed
        evict(self.path)
        start = time.perf_counter()
        self.loaded = torch.load(self.path, weights_only=True)
        return time.perf_counter() - start

    def check(self) -> None:
        if not torch.equal(self.loaded, self.tensor):
            raise AssertionError(f"{self.path}: torch.load returned other values than were saved")


def make_rows(tensor: torch.Tensor, directory: str) -> dict:
    rows = {}
    path = os.path.join(directory, "{}.bin")
    back = aligned_empty(tensor.shape, tensor.dtype)  # one read-back buffer for the AsyncIO rows
    if aio_op() is not None:
        rows["aio op, 1 MiB x qd 8, 1 thread"] = AioRow(tensor, back, path.format("aio1"), False, use_op=True)
        rows["aio op, 4 MiB x qd 8, 4 threads"] = AioRow(tensor, back, path.format("aio4"), False, use_op=True,
                                                         block_size=4 * MiB, thread_count=4)
    rows["aio python fallback, 4 threads"] = AioRow(tensor, back, path.format("aiopy"), True, use_op=False,
                                                    block_size=4 * MiB, thread_count=4)
    if shutil.which("dd"):
        rows["dd bs=4M direct"] = DdRow(tensor.nbytes, path.format("dd"))
    rows["torch.save / torch.load"] = TorchRow(tensor, path.format("torch"))
    return rows


def filesystem(directory: str) -> str:
    try:
        return subprocess.run(["stat", "-f", "-c", "%T", directory], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> dict:
    """Run the benchmark; the results written as JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=os.path.join(REPO, "data", "aio_bench"),
                        help="where the files go (the file system measured)")
    parser.add_argument("--size-mb", type=int, default=1024, help="file size in MiB (a multiple of 4)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "aio.json"))
    args = parser.parse_args(argv)
    if args.size_mb < 4 or args.size_mb % 4:
        parser.error(f"--size-mb must be a positive multiple of 4 (dd's 4 MiB blocks), got {args.size_mb}")
    os.makedirs(args.dir, exist_ok=True)
    nbytes = args.size_mb * MiB
    tensor = aligned_empty(nbytes // 4, torch.float32)
    tensor.copy_(torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(0)))
    rows = make_rows(tensor, args.dir)
    times = {name: {"write": [], "read": []} for name in rows}
    try:
        for _ in range(args.trials):
            for name, row in rows.items():
                times[name]["write"].append(row.write())
            for name, row in rows.items():
                times[name]["read"].append(row.read())
                row.check()
        modes = {name: row.io.backend for name, row in rows.items() if isinstance(row, AioRow)}
    finally:
        for row in rows.values():
            remove(row.path)
    results = {}
    for name, t in times.items():
        results[name] = {f"{kind}_GBps": nbytes / statistics.median(t[kind]) / 1e9 for kind in ("write", "read")}
        if name in modes:
            results[name]["backend"] = modes[name]
    dd = results.get("dd bs=4M direct")
    fs = filesystem(args.dir)
    print(f"{args.size_mb} MiB file in {args.dir} ({fs}), median of {args.trials} alternating trials")
    print(PAGE_CACHE_NOTE)
    print(f"{'row':<34}{'write GB/s':>11}{'read GB/s':>11}{'write/dd':>10}{'read/dd':>9}  backend")
    for name, r in results.items():
        if dd:
            r["write_vs_dd"], r["read_vs_dd"] = r["write_GBps"] / dd["write_GBps"], r["read_GBps"] / dd["read_GBps"]
        ratios = f"{r['write_vs_dd']:>10.2f}{r['read_vs_dd']:>9.2f}" if dd else f"{'':>19}"
        print(f"{name:<34}{r['write_GBps']:>11.2f}{r['read_GBps']:>11.2f}{ratios}  {r.get('backend', '')}")
    report = {"dir": args.dir, "filesystem": fs, "size_bytes": nbytes, "trials": args.trials,
              "page_cache": PAGE_CACHE_NOTE, "results": results}
    write_result("aio", report, args=args, argv=argv, out=args.out)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
