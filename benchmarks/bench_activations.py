"""Activation memory and step time of the recipe's GPT without recomputation, with selective
recomputation (the attention core) and with full recomputation (whole layers), at dropout 0 (the
recipe's) and 0.1.

One process, one thread, micro-batch 4 x 256 tokens, fp32; the three models are copies of one
seeded model and take turns (alternating trials, the same dropout masks for all). Activation
bytes are what the forward keeps for backward (autograd's saved tensors plus checkpointed inputs,
each storage once: megazero.profiling.memory.ActivationMeter). Writes benchmarks/results/activations.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.record import write_result
from megazero.profiling.memory import ActivationMeter
from models.gpt import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODES = {"none": None, "selective": "selective", "full": "full"}


def measure(args, dropout: float) -> dict:
    """Activation bytes, step times and gradient equality of the three modes at one dropout rate."""
    config = GPTConfig.from_json(os.path.join(REPO, "configs", "gpt2_cpu.json"), vocab_size=8000, dropout=dropout)
    models = {}
    for name, granularity in MODES.items():
        torch.manual_seed(0)  # the same weights in every mode
        models[name] = GPT(GPTConfig(**{**config.to_dict(), "recompute_granularity": granularity}),
                           speed_options=True)
    ids = torch.randint(0, config.vocab_size, (args.micro_batch, config.seq_length + 1),
                        generator=torch.Generator().manual_seed(1))
    times = {name: [] for name in models}
    kept, grads = {}, {}
    for trial in range(args.trials + 1):  # the first round warms up
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            torch.manual_seed(trial)  # the same dropout masks in every mode
            start = time.perf_counter()
            with ActivationMeter() as meter:
                loss = model(ids[:, :-1], ids[:, 1:])
            loss.backward()
            if trial:
                times[name].append(time.perf_counter() - start)
            kept[name] = meter.bytes
            grads[name] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    print(f"recipe GPT ({sum(p.numel() for p in models['none'].parameters()) / 1e6:.1f}M params), micro-batch "
          f"{args.micro_batch} x {config.seq_length}, fp32, 1 thread, {args.trials} alternating trials")
    return {name: {"activation_mb": kept[name] / 2 ** 20, "step_s": statistics.median(times[name]),
                   "time_vs_none": statistics.median(t / n for t, n in zip(times[name], times["none"])),
                   "memory_vs_none": kept[name] / kept["none"],
                   "grads_equal_none": bool(torch.equal(grads[name], grads["none"]))} for name in models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "activations.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for dropout in (0.0, 0.1):
        results[f"dropout_{dropout}"] = rows = measure(args, dropout)
        print(f"{'recompute':<11}{'activations MB':>16}{'vs none':>9}{'fwd+bwd s':>11}{'vs none':>9}"
              f"{'grads == none':>15}   (dropout {dropout})")
        for name, row in rows.items():
            print(f"{name:<11}{row['activation_mb']:>16.1f}{row['memory_vs_none']:>9.3f}{row['step_s']:>11.3f}"
                  f"{row['time_vs_none']:>9.3f}{str(row['grads_equal_none']):>15}")
    write_result("activations", {"micro_batch": args.micro_batch, "results": results}, args=args, out=args.out)


if __name__ == "__main__":
    main()
