"""Engine runs on a GPU for scripts/check_gpu.py, one check per call (each in its own process, so
each gets its own process group), printing one JSON object (also written to --json):

  fused          the CPU-sized GPT (configs/gpt2_cpu.json) for a few steps, fp32 and bf16, with
                 fused_kernels on, off, and on with torch's fused AdamW: losses agree within the
                 kernels' tolerances; tokens/s and MFU (against the measured matmul peak) below 100%
  zero BACKEND   ZeRO stages 0-3 at world size 1 over BACKEND (nccl or gloo): per-stage losses
  gpt2           GPT-2 124M (configs/gpt2_124m.json) in bf16: tokens/s and MFU
  multi BACKEND  2 ranks (one GPU each with nccl, the CPU with gloo): ZeRO-2 data parallel, 2
                 pipeline stages (1F1B) and 2 tensor-parallel ranks, per-layout losses

Data are synthetic token ids (no corpus needed on a GPU machine). Exits with a message where
there is no GPU. `--device cpu` rehearses `zero gloo` and `multi gloo` on the CPU (the same code
but the device: tests/unit/test_check_gpu.py runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time

import torch

import megazero
from megazero import parallel_state
from megazero.profiling import gpt_flops_per_token, measure_peak_flops
from models.common import count_parameters
from models.gpt import GPT, GPTConfig
from models.parallelize import parallelize

# run by scripts/check_gpu.py as `python -m benchmarks.gpu_train` from the repository (or after `make install`)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FP32_LOSS_RTOL = 1e-4  # fused LayerNorm / GeLU differ from torch's by fp32 rounding, carried over steps
BF16_LOSS_RTOL = 2e-2


class SyntheticTokens(torch.utils.data.Dataset):
    """`samples` windows of seq_length + 1 token ids, fixed by the seed (GPTDataset's item format)."""

    def __init__(self, vocab_size: int, seq_length: int, samples: int = 1024, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        # a Zipf-like draw, so the loss has something to learn in a few steps
        weights = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)
        self.tokens = torch.multinomial(weights, samples * (seq_length + 1), replacement=True, generator=g)
        self.tokens = self.tokens.view(samples, seq_length + 1)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        chunk = self.tokens[index]
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}


def engine_config(micro: int, bf16: bool, stage: int = 0, torch_adam: bool = False, batch: int | None = None) -> dict:
    """A small engine config (AdamW with clipping, warm-up), as the tests' base config."""
    params = {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}
    if torch_adam:
        params["torch_adam"] = True
    return {"train_batch_size": batch or micro, "train_micro_batch_size_per_gpu": micro,
            "optimizer": {"type": "AdamW", "params": params},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 3}},
            "gradient_clipping": 1.0, "bf16": {"enabled": bf16},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 200000,
                                  "stage3_param_persistence_threshold": 0},
            "steps_per_print": 10 ** 9}


def train(model_config: GPTConfig, config: dict, steps: int, device: str, warmup: int = 0,
          layout: tuple[int, int] | None = None) -> dict:
    """`steps` optimizer steps from seed 0; losses, seconds per step after `warmup` steps."""
    megazero.set_seed(0)
    grid = None
    if layout is not None:
        grid = parallel_state.initialize_model_parallel(*layout)
        model_config = dataclasses.replace(model_config, tensor_model_parallel_size=layout[0])
    model = parallelize(model_config, grid).to(device)
    dataset = SyntheticTokens(model_config.vocab_size, model_config.seq_length)
    engine, _, loader, _ = megazero.initialize(model=model, training_data=dataset, config=config,
                                               mpu=parallel_state if grid else None)
    data = iter(loader)
    losses, start = [], None
    for step in range(steps):
        if step == warmup:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
        losses.append(float(engine.train_batch(data)))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / max(steps - warmup, 1)
    if grid is not None:
        parallel_state.destroy_model_parallel()
    return {"losses": losses, "seconds_per_step": seconds, "optimizer": type(engine.optimizer).__name__}


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def check_fused(steps: int = 8) -> dict:
    """fused_kernels on / off / on with torch's AdamW, fp32 and bf16: losses agree; MFU < 100%."""
    megazero.init_distributed(dist_backend="nccl")
    base = GPTConfig.from_json(os.path.join(REPO, "configs", "gpt2_cpu.json"), vocab_size=8000)
    micro, result, ok = 8, {}, True
    for precision in ("fp32", "bf16"):
        bf16 = precision == "bf16"
        runs = {}
        for name, fused, torch_adam in (("fused", True, False), ("unfused", False, False),
                                        ("fused+torch_adam", True, True)):
            config = dataclasses.replace(base, fused_kernels=fused)
            runs[name] = train(config, engine_config(micro, bf16, torch_adam=torch_adam), steps, "cuda", warmup=2)
        rtol = BF16_LOSS_RTOL if bf16 else FP32_LOSS_RTOL
        diffs = {name: _max_rel(runs[name]["losses"], runs["unfused"]["losses"]) for name in runs if name != "unfused"}
        dtype = torch.bfloat16 if bf16 else torch.float32
        peak = measure_peak_flops(dtype=dtype, device="cuda", cache=False)
        flops = gpt_flops_per_token(count_parameters(GPT, base), base.num_layers, base.hidden_size, base.seq_length)
        tokens_per_s = micro * base.seq_length / runs["fused"]["seconds_per_step"]
        mfu = tokens_per_s * flops / peak
        passed = all(d <= rtol for d in diffs.values()) and 0 < mfu < 1
        ok = ok and passed
        result[precision] = {"passed": passed, "max_rel_loss_diff": diffs, "rtol": rtol,
                             "losses": {k: v["losses"] for k, v in runs.items()},
                             "optimizers": {k: v["optimizer"] for k, v in runs.items()},
                             "tokens_per_s": tokens_per_s, "peak_tflops": peak / 1e12, "mfu": mfu}
    result["passed"] = ok
    return result


def check_zero(backend: str, steps: int = 4, device: str = "cuda") -> dict:
    """ZeRO stages 0-3 on one GPU (or `device`) at world size 1 over `backend`: per-stage losses
    (dropout on: the stages draw the same masks)."""
    megazero.init_distributed(dist_backend=backend)
    base = GPTConfig.from_json(os.path.join(REPO, "configs", "gpt2_cpu.json"), vocab_size=8000, num_layers=2,
                               dropout=0.1)
    out = {}
    for stage in range(4):
        out[str(stage)] = train(base, engine_config(4, False, stage=stage), steps, device)["losses"]
    return {"backend": backend, "losses": out, "passed": True}


def check_gpt2(steps: int = 12, warmup: int = 3, micro: int = 16) -> dict:
    """GPT-2 124M in bf16 on one GPU: tokens/s and MFU against the measured bf16 matmul peak."""
    megazero.init_distributed(dist_backend="nccl")
    config = GPTConfig.from_json(os.path.join(REPO, "configs", "gpt2_124m.json"), dropout=0.0)
    run = train(config, engine_config(micro, True), steps, "cuda", warmup=warmup)
    peak = measure_peak_flops(dtype=torch.bfloat16, device="cuda", cache=False)
    flops = gpt_flops_per_token(count_parameters(GPT, config), config.num_layers, config.hidden_size,
                                config.seq_length)
    tokens_per_s = micro * config.seq_length / run["seconds_per_step"]
    mfu = tokens_per_s * flops / peak
    return {"tokens_per_s": tokens_per_s, "mfu": mfu, "peak_tflops": peak / 1e12, "micro_batch": micro,
            "seconds_per_step": run["seconds_per_step"], "losses": run["losses"], "optimizer": run["optimizer"],
            "goal_mfu": 0.45, "passed": 0 < mfu < 1}


MULTI_LAYOUTS = {"zero2-dp2": (None, 2), "pp2-1f1b": ((1, 2), 0), "tp2": ((2, 1), 0)}


def _multi_rank(rank: int, world: int, port: int, backend: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        megazero.init_distributed(dist_backend=backend)
        device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        base = GPTConfig.from_json(os.path.join(REPO, "configs", "gpt2_cpu.json"), vocab_size=8000, num_layers=2)
        out = {}
        for name, (layout, stage) in MULTI_LAYOUTS.items():
            dp = world // (layout[0] * layout[1]) if layout else world
            config = engine_config(4, False, stage=stage, batch=4 * dp * (2 if layout and layout[1] > 1 else 1))
            out[name] = train(base, config, 4, device, layout=layout)["losses"]
        queue.put((rank, out))
    except BaseException as e:  # report, so the parent does not wait for ever
        queue.put((rank, {"error": f"{type(e).__name__}: {e}"}))


def check_multi(backend: str, world: int = 2) -> dict:
    """`world` ranks over `backend` (nccl: one GPU each): per-layout losses of rank 0."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_multi_rank, args=(r, world, port, backend, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    errors = {r: v["error"] for r, v in results.items() if "error" in v}
    return {"backend": backend, "losses": results.get(0, {}), "errors": errors, "passed": not errors}


def main(argv=None) -> int:
    """Run one check; print (and write to --json) its result."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("check", choices=["fused", "zero", "gpt2", "multi"])
    p.add_argument("backend", nargs="?", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: rehearse `zero gloo` or `multi gloo` without a GPU")
    args = p.parse_args(argv)
    if args.device == "cpu" and (args.check not in ("zero", "multi") or args.backend != "gloo"):
        p.error("--device cpu rehearses `zero gloo` and `multi gloo` only")
    if args.device == "cuda" and (torch.version.cuda is None or not torch.cuda.is_available()):
        sys.exit("no GPU (or a CPU build of torch): nothing to check here")
    if args.check == "fused":
        result = check_fused()
    elif args.check == "zero":
        result = check_zero(args.backend, device=args.device)
    elif args.check == "gpt2":
        result = check_gpt2()
    else:
        result = check_multi(args.backend)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if result.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
