"""Plot loss, learning rate and throughput curves from TensorBoard logs (one or several runs) to PNG.

    python scripts/plot_logs.py runs/gpt2_cpu runs/other_run --out curves.png
"""

from __future__ import annotations

import argparse
import os
import sys

PANELS = (("lm loss", "lm loss (train)", "lm loss validation"), ("learning-rate", "learning rate", None),
          ("throughput/tokens-per-sec", "tokens/s", None))


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every scalar in a TensorBoard log directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def plot_runs(runs: dict[str, dict], out: str) -> list[str]:
    """One panel per quantity, one line per run; returns the tags drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    drawn = []
    for ax, (tag, title, extra) in zip(axes, PANELS):
        for name, scalars in runs.items():
            for t, style in ((tag, "-"), (extra, "--")):
                if t and t in scalars:
                    steps, values = zip(*scalars[t])
                    ax.plot(steps, values, style, label=f"{name}: {t}")
                    drawn.append(t)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return drawn


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log_dirs", nargs="+", help="TensorBoard log directories")
    parser.add_argument("--out", default="curves.png")
    args = parser.parse_args(argv)
    runs = {}
    for log_dir in args.log_dirs:
        if not os.path.isdir(log_dir):
            sys.exit(f"log directory not found: {log_dir}")
        runs[os.path.basename(os.path.normpath(log_dir))] = read_scalars(log_dir)
    drawn = plot_runs(runs, args.out)
    if not drawn:
        sys.exit(f"no known scalars ({', '.join(t for t, _, _ in PANELS)}) in {args.log_dirs}")
    print(f"wrote {args.out}: {len(runs)} run(s), {', '.join(sorted(set(drawn)))}")


if __name__ == "__main__":
    main()
