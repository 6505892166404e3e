"""The real MoE GPT (models/gpt.py with num_experts, built by models/parallelize.py as the recipes
build it) in the engine at EP=2 on DP=2 against the single process on the same global batch, for
10 steps: losses (with the auxiliary losses) within 1e-5 relative, every weight within 2e-5, the
MoE statistics (tokens dropped, tokens per expert) equal, in dropless mode (ZeRO 1) and capacity
mode (capacity factor 1.0: it drops tokens; ZeRO 2). Then the checkpoint the EP=2 run saved loads
in the single process (EP=1, DP=1: experts re-cut, ZeRO partitions joined) and continues as the
EP=2 run does.

Dropout is 0 here, and must be for this claim, which is why: the engine draws dropout masks per
micro-batch (MicroBatchStreams, keyed by step and micro-batch index), while an MoE layer at EP=2
routes the tokens of both DP ranks' micro-batches together (capacity and the load-balancing loss
are over the EP group's tokens). The single process that routes the same tokens together must
take them as one micro-batch, so it draws one mask where the EP run draws two: no layout of the
single process has both the EP run's routing and its masks. (Inside the MoE layer nothing draws
random numbers: the experts after the all-to-all have no dropout; the block's dropout is on this
rank's own tokens.) Dropout with MoE is covered by the recipe test, which trains with it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import megazero
from megazero import parallel_state
from megazero.moe import moe_stats
from models.gpt import GPTConfig
from models.parallelize import parallelize

VOCAB, SEQ, BATCH, STEPS, MORE = 64, 16, 4, 10, 2
LOSS_RTOL, PARAM_ATOL = 1e-5, 2e-5
MODES = {"dropless": (None, 1), "capacity": (1.0, 2)}  # mode: (capacity factor, ZeRO stage)
STATS = ("dropped_fraction", "tokens_per_expert_min", "tokens_per_expert_max")


def _config(factor: float | None) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, seq_length=SEQ, num_layers=2, hidden_size=32, num_attention_heads=2,
                     make_vocab_size_divisible_by=16, num_experts=4, moe_router_topk=2, moe_capacity_factor=factor,
                     moe_z_loss_coeff=1e-3)


def _engine(factor: float | None, stage: int, ep: int | None):
    """ep None: the single process without a grid; else the grid with that EP size over the world."""
    grid = parallel_state.initialize_model_parallel(1, 1, ep) if ep is not None else None
    torch.manual_seed(0)  # every layout builds the same model
    model = parallelize(_config(factor), grid)
    dp = dist.get_world_size() if grid is not None else 1
    config = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // dp,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
              "gradient_clipping": 1.0, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000}}  # several buckets
    engine, *_ = megazero.initialize(model=model, config=config, mpu=parallel_state if grid is not None else None)
    return engine


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))


def _train(engine, steps: int, start: int = 0) -> dict:
    """Optimizer steps on the global batches from `start`, this DP rank's slice of each (rank r's
    samples come r-th: the EP group routes the concatenated batch, rank 0's tokens first)."""
    dp, rank, micro = engine.dp_world_size, engine.dp_rank, engine.train_micro_batch_size_per_gpu()
    losses, stats = [], []
    for step in range(start, start + steps):
        ids = _batch(step)[rank * micro:(rank + 1) * micro]
        loss = engine(ids[:, :-1], labels=ids[:, 1:])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(mean, group=engine.dp_group)
        losses.append(mean.item() / dp)
        stats.append(moe_stats(engine.module))
    return {"losses": losses, "stats": stats, "params": _full_params(engine)}


def _full_params(engine) -> dict[str, torch.Tensor]:
    """The whole model: each expert parameter's EP slices joined in global expert order."""
    group = engine.module.blocks[0].mlp.ep_group  # the MoE layers' (None in the single process)
    ep = dist.get_world_size(group) if group is not None else 1
    out = {}
    for name, param in engine.module.named_parameters():
        p = param.detach().clone()
        if getattr(param, "megazero_expert", False) and ep > 1:
            assert param.megazero_expert_first == dist.get_rank(group) * p.shape[0], name
            pieces = [torch.empty_like(p) for _ in range(ep)]
            dist.all_gather(pieces, p.contiguous(), group=group)
            p = torch.cat(pieces)
        out[name] = p
    return out


def run_expert_parallel(save_dir: str) -> dict:
    """Each mode at EP=2 (DP=2): 10 steps, save, 2 more."""
    out = {}
    for mode, (factor, stage) in MODES.items():
        engine = _engine(factor, stage, 2)
        out[mode] = _train(engine, STEPS)
        engine.save_checkpoint(f"{save_dir}/{mode}", "ep2")
        out[mode]["next"] = _train(engine, MORE, start=STEPS)
    return out


def run_single_process(save_dir: str) -> dict:
    """Each mode in one process (EP=1, DP=1): 10 steps; then a fresh engine loads the EP=2
    checkpoint and trains the 2 steps that followed it."""
    out = {}
    for mode, (factor, stage) in MODES.items():
        out[mode] = _train(_engine(factor, 0, None), STEPS)
        loaded = _engine(factor, stage, None)
        loaded.load_checkpoint(f"{save_dir}/{mode}", "ep2")
        assert loaded.global_steps == STEPS
        out[mode]["next"] = _train(loaded, MORE, start=STEPS)
    return out


def _assert_same_run(ref: dict, other: dict, what: str) -> None:
    for step, (a, b) in enumerate(zip(ref["losses"], other["losses"], strict=True)):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"{what} step {step}: loss {a} vs {b}"
    for step, (a, b) in enumerate(zip(ref["stats"], other["stats"], strict=True)):
        for key in STATS:  # the same tokens dropped, the same load per expert
            assert abs(a[key] - b[key]) <= 1e-9, f"{what} step {step}: {key} {a[key]} vs {b[key]}"
        assert abs(a["load_balancing"] - b["load_balancing"]) <= 1e-6, f"{what} step {step}: aux loss"
    assert ref["params"].keys() == other["params"].keys()
    for name, p in ref["params"].items():
        torch.testing.assert_close(other["params"][name], p, rtol=0, atol=PARAM_ATOL, msg=f"{what}: {name}")


def test_moe_gpt_expert_parallel_matches_single_process(pools, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    ep_runs = pools(2).run(run_expert_parallel, save_dir)
    ref = pools(1).run(run_single_process, save_dir)[0]
    for mode in MODES:
        losses = ref[mode]["losses"]
        assert losses[-1] < losses[0], f"{mode}: the reference does not train: {losses}"
        dropped = [s["dropped_fraction"] for s in ref[mode]["stats"]]
        assert (max(dropped) > 0) == (mode == "capacity"), f"{mode}: dropped fractions {dropped}"
        for rank, run in enumerate(ep_runs):
            _assert_same_run(ref[mode], run[mode], f"{mode} EP=2 rank {rank}")
            # the EP=2 checkpoint continues in the single process as it did at EP=2
            _assert_same_run(run[mode]["next"], ref[mode]["next"], f"{mode} EP=2 -> EP=1 rank {rank}")
