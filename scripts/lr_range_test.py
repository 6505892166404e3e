"""LR range test: train the recipe with DeepSpeed's `LRRangeTest` schedule and suggest a max LR.

The LR grows linearly from --min-lr to --max-lr over --steps optimizer steps (stopping early once the
smoothed loss exceeds 4x its minimum). The (lr, loss) curve goes to TensorBoard and to a PNG plot;
the suggestion is the LR of steepest descent of the smoothed loss against log(lr), before its
minimum: a good `cycle_max_lr` for `OneCycle`. Other flags are pretrain_gpt.py's (model, data, batch).

    python scripts/lr_range_test.py --data-path data/gpt2/shakespeare --steps 100 --output-dir runs/lr_range
"""

import argparse
import math
import os

import numpy as np
import torch
from pydantic import Field
from torch.utils.tensorboard import SummaryWriter

import megazero
from megazero import parallel_state, training
from megazero.config.cli import CONFIGS, model_config_of, model_section, parse_run
from megazero.config.run import RunConfig, SampleSection
from megazero.data import GPTDataset
from megazero.data.vocab_check import check_token_ids
from models.gpt import GPTConfig
from models.parallelize import parallelize

RUN_FILE = os.path.join(CONFIGS, "run_gpt2_cpu.json")  # the recipe's settings; --config replaces it


def smooth(losses: list[float], beta: float = 0.9) -> np.ndarray:
    """Bias-corrected exponential moving average."""
    out, avg = [], 0.0
    for i, loss in enumerate(losses, 1):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta ** i))
    return np.array(out)


def suggest_lr(lrs: list[float], losses: list[float]) -> float:
    """LR where the smoothed loss falls fastest against log(lr), before the loss minimum."""
    smoothed = smooth(losses)
    end = int(np.argmin(smoothed)) + 1
    if end < 3:
        return float(lrs[max(end - 1, 0)])
    slopes = np.gradient(smoothed[:end], np.log(np.array(lrs[:end])))
    return float(lrs[int(np.argmin(slopes))])


def plot(lrs: list[float], losses: list[float], suggestion: float, path: str) -> None:
    """loss (raw and smoothed) against lr on a log axis, with the suggestion marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(lrs, losses, alpha=0.35, label="loss")
    ax.plot(lrs, smooth(losses), label="smoothed loss")
    ax.axvline(suggestion, color="red", linestyle="--", label=f"suggested max lr {suggestion:.2e}")
    ax.set(xscale="log", xlabel="learning rate", ylabel="lm loss", title="LR range test")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


GPTModel = model_section(GPTConfig)


class RangeTestRun(RunConfig):
    """pretrain_gpt.py's run tree (its sample flags accepted, though nothing is sampled)."""

    model: GPTModel = Field(default_factory=GPTModel)
    sample: SampleSection = SampleSection()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-lr", type=float, default=1e-5)
    parser.add_argument("--max-lr", type=float, default=1e-1)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--output-dir", default="runs/lr_range_test")
    own, rest = parser.parse_known_args(argv)
    return own, parse_run(RangeTestRun, rest + ["--train-iters", str(own.steps)], RUN_FILE, __doc__)


def main(argv=None) -> dict:
    own, run = parse_args(argv)
    _, grid, tokenizer = training.start_run(run)
    model = parallelize(model_config_of(run, GPTConfig, tokenizer.vocab_size), grid)

    def make(indexed, split: str) -> GPTDataset:  # each dataset checked (a blend has no one .indexed)
        check_token_ids(indexed, tokenizer.vocab_size, run.data.tokenizer_spec().describe())
        return GPTDataset(indexed, model.config.seq_length, seed=run.seed)

    train = training.build_datasets(run, make).train
    config = dict(run.engine)
    config.pop("tensorboard", None)
    config["scheduler"] = {"type": "LRRangeTest", "params": {
        "lr_range_test_min_lr": own.min_lr, "lr_range_test_step_size": 1,
        "lr_range_test_step_rate": (own.max_lr / own.min_lr - 1) / max(own.steps - 1, 1)}}
    engine, _, loader, _ = megazero.initialize(model=model, model_parameters=training.param_groups(model),
                                               training_data=train, config=config, mpu=parallel_state)
    data = iter(loader)
    lrs, losses = [], []
    for _ in range(own.steps):
        lr = engine.get_lr()[0]
        loss = training.average_across_ranks(engine.train_batch(data).item(), engine.dp_group)
        lrs.append(lr)
        losses.append(loss)
        if not math.isfinite(loss) or smooth(losses)[-1] > 4 * min(smooth(losses)):
            break  # diverged
    suggestion = suggest_lr(lrs, losses)
    if engine.global_rank == 0:
        os.makedirs(own.output_dir, exist_ok=True)
        with SummaryWriter(own.output_dir) as writer:
            for step, (lr, loss) in enumerate(zip(lrs, losses)):
                writer.add_scalar("lr-range-test/lm loss", loss, step)
                writer.add_scalar("lr-range-test/learning-rate", lr, step)
        plot(lrs, losses, suggestion, os.path.join(own.output_dir, "lr_range_test.png"))
        print(f"swept lr {lrs[0]:.2e} .. {lrs[-1]:.2e} over {len(lrs)} steps; loss {losses[0]:.3f} -> "
              f"min {min(losses):.3f}")
        print(f"suggested max lr: {suggestion:.3e}  (OneCycle: cycle_max_lr {suggestion:.3e}, "
              f"cycle_min_lr {suggestion / 10:.3e})")
        print(f"plot: {os.path.join(own.output_dir, 'lr_range_test.png')}")
    torch.distributed.barrier()
    return {"lrs": lrs, "losses": losses, "suggestion": suggestion}


if __name__ == "__main__":
    main()
