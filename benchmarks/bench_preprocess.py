"""Streaming preprocessing at scale (issue 20) and the blend index build.

Generates jsonl corpora of --size-mb and twice that from the default corpus' text (data/shakespeare,
cut into ~4 KB documents and repeated), then runs scripts/preprocess_data.py on them (the corpus'
tokenizer, --valid-fraction 0.05) as a user does, each in its own process, measuring wall time and
the peak RSS of the process and its workers (RUSAGE_CHILDREN maxrss of each). Rows: the first
corpus with 1 and 2 workers (MB/s, speed-up), the second with 2 workers (peak RSS must not grow with
the corpus). Then the time to build the blend index of 3 datasets for 10M samples. The generated
corpora and outputs are deleted afterwards. Writes benchmarks/results/preprocess.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks.record import write_result

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURE = """
import resource, subprocess, sys, time
start = time.perf_counter()
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def generate(path: str, size_mb: float, corpus_dir: str) -> int:
    """A jsonl file of about size_mb, ~4 KB documents of the corpus text repeated; returns its bytes."""
    text = "".join(open(os.path.join(corpus_dir, f), encoding="utf-8").read()
                   for f in sorted(os.listdir(corpus_dir)) if f.endswith(".txt"))
    pieces = [json.dumps({"text": text[i:i + 4096]}) + "\n" for i in range(0, len(text), 4096)]
    encoded = [p.encode() for p in pieces]
    with open(path, "wb") as f:  # whole documents until the size is reached (the corpus repeated)
        written, i = 0, 0
        while written < size_mb * 2**20:
            f.write(encoded[i % len(encoded)])
            written += len(encoded[i % len(encoded)])
            i += 1
    return written


def run(input_path: str, out_dir: str, workers: int, tokenizer: str) -> dict:
    """preprocess_data.py over one file: wall seconds, MB/s of input, peak RSS (MB) of any of its processes."""
    cmd = [sys.executable, "-c", MEASURE, sys.executable, os.path.join(REPO, "scripts", "preprocess_data.py"),
           "--input", input_path, "--output-prefix", os.path.join(out_dir, "out"), "--tokenizer-model", tokenizer,
           "--workers", str(workers), "--log-interval", "1000000"]
    seconds, rss_kb = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-2:]
    size = os.path.getsize(input_path)
    shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    return {"input_mb": size / 2**20, "workers": workers, "seconds": float(seconds),
            "mb_per_s": size / 2**20 / float(seconds), "peak_rss_mb": int(rss_kb) / 1024}


def blend_build_seconds(samples: int) -> float:
    """Wall time of build_blend_indices for 3 datasets (0.5/0.3/0.2) and `samples` samples."""
    from megazero.data.blended_dataset import build_blend_indices

    start = time.perf_counter()
    build_blend_indices([0.5, 0.3, 0.2], samples)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mb", type=float, default=1024, help="the first corpus (the second is twice this)")
    parser.add_argument("--blend-samples", type=int, default=10_000_000)
    parser.add_argument("--data-dir", default=os.path.join(REPO, "data"))
    parser.add_argument("--work-dir", default=None, help="where the corpora are generated (default: a temp dir)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "preprocess.json"))
    args = parser.parse_args()
    tokenizer = os.path.join(args.data_dir, "gpt2", "shakespeare_tokenizer.model")
    corpus = os.path.join(args.data_dir, "shakespeare")
    result = {"blend_index_seconds": blend_build_seconds(args.blend_samples), "blend_samples": args.blend_samples,
              "cpus": os.cpu_count(), "runs": []}
    print(f"blend index, 3 datasets x {args.blend_samples:,} samples: {result['blend_index_seconds']:.2f} s",
          flush=True)
    if args.work_dir:
        os.makedirs(args.work_dir, exist_ok=True)
    work = tempfile.mkdtemp(dir=args.work_dir, prefix="bench_preprocess_")
    try:
        out_dir = os.path.join(work, "out")
        os.makedirs(out_dir)
        small, large = os.path.join(work, "small.jsonl"), os.path.join(work, "large.jsonl")
        generate(small, args.size_mb, corpus)
        for workers in (1, 2):
            result["runs"].append(run(small, out_dir, workers, tokenizer))
            print(result["runs"][-1], flush=True)
        os.remove(small)
        generate(large, 2 * args.size_mb, corpus)
        result["runs"].append(run(large, out_dir, 2, tokenizer))
        print(result["runs"][-1], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    one, two, big = result["runs"]
    result["speedup_2_workers"] = two["mb_per_s"] / one["mb_per_s"]
    result["rss_growth_1x_to_2x"] = big["peak_rss_mb"] / two["peak_rss_mb"]
    print(f"{'input':>10}{'workers':>9}{'seconds':>10}{'MB/s':>8}{'peak RSS MB':>13}")
    for r in result["runs"]:
        print(f"{r['input_mb']:>9.0f}M{r['workers']:>9}{r['seconds']:>10.1f}{r['mb_per_s']:>8.2f}{r['peak_rss_mb']:>13.0f}")
    print(f"2 workers / 1: x{result['speedup_2_workers']:.2f}; peak RSS {2 * args.size_mb:.0f} MB / "
          f"{args.size_mb:.0f} MB input: x{result['rss_growth_1x_to_2x']:.2f}")
    write_result("preprocess", result, args=args, out=args.out)


if __name__ == "__main__":
    main()
