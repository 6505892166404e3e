"""The real MoE GPT (models/gpt.py with num_experts, built by models/parallelize.py as the recipes
build it) in the engine at EP=2 on DP=2 against the single process on the same global batch, for
10 steps: losses (with the auxiliary losses) within 1e-5 relative, every weight within 2e-5, the
MoE statistics (tokens dropped, tokens per expert) equal, in dropless mode (ZeRO 1) and capacity
mode (capacity factor 1.0: it drops tokens; ZeRO 2). Then the checkpoint the EP=2 run saved loads
in the single process (EP=1, DP=1: experts re-cut, ZeRO partitions joined) and continues as the
EP=2 run does.

Dropout is 0.1 throughout, with `dropout_masks.layout_invariant` (per-sample masks): the default
masks are keyed per micro-batch, while an MoE layer at EP=2 routes the tokens of both DP ranks'
micro-batches together (capacity and the load-balancing loss are over the EP group's tokens), so
the single process that routes the same tokens together takes them as one micro-batch and would
draw one mask where the EP run draws two.

The same at EP=2 x TP=2, at EP=2 x PP=2 and at EP=2 x TP=2 with sequence parallelism (the MoE
layers gather the sequence over TP: megazero/moe/sequence.py), and the MoE Llama (SwiGLU experts) at
EP=2 x PP=2 (4 ranks each, EP=2 over DP=2, 2 micro-batches of
one sample per rank, so that the 1/accumulation gradient scale of the auxiliary losses is used)
with dropout 0.1 (layout-invariant masks) against the single process with 2 micro-batches of 2
samples: micro-batch m of the EP group is
rank 0's sample 2m then rank 1's 2m + 1, the single process's micro-batch m. At PP=2 the first
stage's MoE layer is on a stage without the loss: its auxiliary losses train through its output
(megazero/moe/aux_loss.py) and the step's loss and the MoE statistics cover both stages. The
EP x PP checkpoint loads in the single process and continues as the EP x PP run does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import megazero
from megazero import parallel_state
from megazero.model_contract import global_name_of
from megazero.moe import moe_stats
from megazero.tensor_parallel.utils import merge_shards, partition_of
from models.gpt import GPTConfig
from models.llama import LlamaConfig
from models.parallelize import parallelize

VOCAB, SEQ, BATCH, STEPS, MORE = 64, 16, 4, 10, 2
LOSS_RTOL, PARAM_ATOL = 1e-5, 2e-5
MODES = {"dropless": (None, 1), "capacity": (1.0, 2)}  # mode: (capacity factor, ZeRO stage)
DROPOUT = 0.1  # of every run here, with layout-invariant masks
STATS = ("dropped_fraction", "tokens_per_expert_min", "tokens_per_expert_max")


# (TP, PP, sequence parallel, model) with EP=2 over DP=2 on 4 ranks
LAYOUTS = {"ep2_tp2": (2, 1, False, "gpt"), "ep2_pp2": (1, 2, False, "gpt"), "ep2_tp2_sp": (2, 1, True, "gpt"),
           "llama_ep2_pp2": (1, 2, False, "llama")}
ZERO3_LAYOUT = ("ep2_tp2_sp", "capacity, ZeRO-3")


def _config(factor: float | None, tp: int = 1, sp: bool = False, model: str = "gpt",
            dropout: float = 0.0) -> GPTConfig | LlamaConfig:
    config_class = GPTConfig if model == "gpt" else LlamaConfig
    return config_class(vocab_size=VOCAB, seq_length=SEQ, num_layers=2, hidden_size=32, num_attention_heads=2,
                        make_vocab_size_divisible_by=16, num_experts=4, moe_router_topk=2, moe_capacity_factor=factor,
                        moe_z_loss_coeff=1e-3, tensor_model_parallel_size=tp, sequence_parallel=sp, dropout=dropout)


def _engine(factor: float | None, stage: int, ep: int | None, tp: int = 1, pp: int = 1, micro: int | None = None,
            sp: bool = False, model: str = "gpt", dropout: float = 0.0):
    """ep None: the single process without a grid; else the grid with that EP (and TP, PP) size over
    the world. micro: samples per micro-batch (default: the global batch over DP, one micro-batch).
    dropout > 0: with layout-invariant masks (per sample and head), which every layout draws alike."""
    grid = parallel_state.initialize_model_parallel(tp, pp, ep) if ep is not None else None
    torch.manual_seed(0)  # every layout builds the same model
    model = parallelize(_config(factor, tp, sp, model, dropout), grid)
    dp = grid.data_parallel_size if grid is not None else 1
    config = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": micro or BATCH // dp,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
              "gradient_clipping": 1.0, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000},  # several buckets
              "dropout_masks": {"layout_invariant": dropout > 0}}
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


def _train_batches(engine, steps: int, start: int = 0) -> dict:
    """train_batch() on the global batches from `start`: micro-batch m of DP rank r is sample
    m * DP + r (the single process's, DP=1: samples [m * micro, +micro)); the loss averaged over DP,
    the MoE statistics over every pipeline stage."""
    grid = engine.grid
    dp, rank, micro = engine.dp_world_size, engine.dp_rank, engine.train_micro_batch_size_per_gpu()
    pp_group = grid.pp_group if grid is not None and grid.pipeline_model_parallel_size > 1 else None
    losses, stats = [], []
    for step in range(start, start + steps):
        ids = _batch(step)
        batches = [ids[m * dp * micro + rank * micro:][:micro] for m in range(engine.gradient_accumulation_steps())]
        loss = engine.train_batch(iter({"input_ids": b[:, :-1], "labels": b[:, 1:]} for b in batches))
        if dp > 1:
            dist.all_reduce(loss, group=engine.dp_group)
        losses.append(loss.item() / dp)
        stats.append(moe_stats(engine.module, pp_group))
    return {"losses": losses, "stats": stats, "params": _full_params(engine)}


def _full_params(engine) -> dict[str, torch.Tensor]:
    """The parameters this rank holds, whole and under their names in the whole model: each expert
    parameter's EP slices joined in global expert order, tensor-parallel shards merged."""
    grid = engine.grid
    ep_group = grid.ep_group if grid is not None else None  # None in the single process and at EP=1
    ep = dist.get_world_size(ep_group) if ep_group is not None else 1
    tp = grid.tensor_model_parallel_size if grid is not None else 1
    name_of, out = global_name_of(engine.module), {}
    with megazero.zero.GatheredParameters(list(engine.module.parameters())):  # (ZeRO-3: whole here)
        for name, param in engine.module.named_parameters():
            out[name_of(name)] = _whole(param, grid, ep_group, ep, tp)
    return out


def _whole(param: torch.nn.Parameter, grid, ep_group, ep: int, tp: int) -> torch.Tensor:
    """One parameter with every EP rank's experts and every TP rank's shard."""
    p = param.detach().clone()
    if getattr(param, "megazero_expert", False) and ep > 1:
        assert param.megazero_expert_first == dist.get_rank(ep_group) * p.shape[0]
        pieces = [torch.empty_like(p) for _ in range(ep)]
        dist.all_gather(pieces, p.contiguous(), group=ep_group)
        p = torch.cat(pieces)
    dim, stride = partition_of(param)
    if dim is not None and tp > 1:
        shards = [torch.empty_like(p) for _ in range(tp)]
        dist.all_gather(shards, p.contiguous(), group=grid.tp_group)
        p = merge_shards(shards, dim, stride)
    return p


def run_expert_parallel(save_dir: str) -> dict:
    """Each mode at EP=2 (DP=2): 10 steps, save, 2 more."""
    out = {}
    for mode, (factor, stage) in MODES.items():
        engine = _engine(factor, stage, 2, dropout=DROPOUT)
        out[mode] = _train(engine, STEPS)
        engine.save_checkpoint(f"{save_dir}/{mode}", "ep2")
        out[mode]["next"] = _train(engine, MORE, start=STEPS)
    return out


def run_single_process(save_dir: str) -> dict:
    """Each mode in one process (EP=1, DP=1): 10 steps; then a fresh engine loads the EP=2
    checkpoint and trains the 2 steps that followed it."""
    out = {}
    for mode, (factor, stage) in MODES.items():
        out[mode] = _train(_engine(factor, 0, None, dropout=DROPOUT), STEPS)
        loaded = _engine(factor, stage, None, dropout=DROPOUT)
        loaded.load_checkpoint(f"{save_dir}/{mode}", "ep2")
        assert loaded.global_steps == STEPS
        out[mode]["next"] = _train(loaded, MORE, start=STEPS)
    return out


def run_model_parallel_layouts(save_dir: str) -> dict:
    """Each layout of LAYOUTS and each mode (4 ranks): 10 steps; the GPT EP x PP run saves, and 2 more."""
    out = {}
    for layout, (tp, pp, sp, model) in LAYOUTS.items():
        for mode, (factor, stage) in MODES.items():
            engine = _engine(factor, stage, 2, tp, pp, micro=1, sp=sp, model=model, dropout=DROPOUT)
            out[layout, mode] = run = _train_batches(engine, STEPS)
            if pp > 1 and model == "gpt":
                engine.save_checkpoint(f"{save_dir}/{layout}-{mode}", "ep2pp2")
                run["next"] = _train_batches(engine, MORE, start=STEPS)
    # ZeRO-3 inside EP=2 x TP=2 + SP: the dense shards over DP=2, each rank's experts alone
    engine = _engine(MODES["capacity"][0], 3, 2, 2, 1, micro=1, sp=True, dropout=DROPOUT)
    out[ZERO3_LAYOUT] = _train_batches(engine, STEPS)
    return out


def run_single_process_accumulating(save_dir: str) -> dict:
    """Each mode in one process, 2 micro-batches of 2 samples: 10 steps; then a fresh engine loads
    the EP x PP checkpoint (EP=1, PP=1: experts re-cut, stages joined) and trains 2 more. The MoE
    Llama's 10 steps under ("llama", mode)."""
    out = {}
    for mode, (factor, stage) in MODES.items():
        out["llama", mode] = _train_batches(_engine(factor, 0, None, micro=2, model="llama", dropout=DROPOUT), STEPS)
        out[mode] = _train_batches(_engine(factor, 0, None, micro=2, dropout=DROPOUT), STEPS)
        loaded = _engine(factor, stage, None, micro=2, dropout=DROPOUT)
        loaded.load_checkpoint(f"{save_dir}/ep2_pp2-{mode}", "ep2pp2")
        assert loaded.global_steps == STEPS
        out[mode]["next"] = _train_batches(loaded, MORE, start=STEPS)
    return out


def _assert_same_losses(ref: dict, other: dict, what: str) -> None:
    for step, (a, b) in enumerate(zip(ref["losses"], other["losses"], strict=True)):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"{what} step {step}: loss {a} vs {b}"
    for step, (a, b) in enumerate(zip(ref["stats"], other["stats"], strict=True)):
        for key in STATS:  # the same tokens dropped, the same load per expert
            assert abs(a[key] - b[key]) <= 1e-9, f"{what} step {step}: {key} {a[key]} vs {b[key]}"
        assert abs(a["load_balancing"] - b["load_balancing"]) <= 1e-6, f"{what} step {step}: aux loss"


def _assert_params_close(ref: dict, other: dict, what: str) -> None:
    """Every parameter of `other` (a pipeline stage's: some of the model's) as in `ref`."""
    for name, p in other.items():
        torch.testing.assert_close(p, ref[name], rtol=0, atol=PARAM_ATOL, msg=f"{what}: {name}")


def _assert_same_run(ref: dict, other: dict, what: str) -> None:
    _assert_same_losses(ref, other, what)
    assert ref["params"].keys() == other["params"].keys()
    _assert_params_close(ref["params"], other["params"], what)


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


def test_moe_gpt_ep_tp_and_ep_pp_match_single_process(pools, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    runs = pools(4).run(run_model_parallel_layouts, save_dir)
    ref = pools(1).run(run_single_process_accumulating, save_dir)[0]
    for mode in MODES:
        for key in (mode, ("llama", mode)):
            dropped = [s["dropped_fraction"] for s in ref[key]["stats"]]
            assert (max(dropped) > 0) == (mode == "capacity"), f"{key}: dropped fractions {dropped}"
        for layout, (_, pp, _, model) in LAYOUTS.items():
            expected = ref[mode] if model == "gpt" else ref[model, mode]
            names = set()  # the whole model from the ranks' parameters (a pipeline stage holds some)
            for rank, run in enumerate(runs):
                mine, what = run[layout, mode], f"{mode} {layout} rank {rank}"
                _assert_same_losses(expected, mine, what)
                _assert_params_close(expected["params"], mine["params"], what)
                names |= mine["params"].keys()
                # the GPT EP x PP checkpoint continues in the single process as it did at EP x PP
                if pp > 1 and model == "gpt":
                    _assert_same_losses(mine["next"], ref[mode]["next"], f"{what} -> EP=1 PP=1")
                    _assert_params_close(ref[mode]["next"]["params"], mine["next"]["params"], f"{what} -> EP=1 PP=1")
            assert names == expected["params"].keys(), f"{mode} {layout}: parameters missing"
    for rank, run in enumerate(runs):
        _assert_same_run(ref["capacity"], run[ZERO3_LAYOUT], f"capacity EP=2 x TP=2 + SP ZeRO-3 rank {rank}")


def test_aux_losses_train_under_recomputation():
    """Full recomputation with partition_activations (megazero's checkpoint: the first forward runs
    without a graph) and without (torch's): the aux losses still get their gradient, through the
    recomputed layer's output (GPT's GeLU and Llama's SwiGLU experts)."""
    from megazero import activation_checkpointing
    from models.llama import LlamaConfig

    shape = dict(vocab_size=VOCAB, seq_length=SEQ, num_layers=2, hidden_size=32, num_attention_heads=2,
                 make_vocab_size_divisible_by=16, num_experts=4, moe_capacity_factor=1.0, moe_z_loss_coeff=1e-3)
    ids = _batch(0)
    for config_class in (GPTConfig, LlamaConfig):
        grads = []
        for recompute, partition in ((None, False), ("full", False), ("full", True)):
            torch.manual_seed(0)
            model = parallelize(config_class(**shape, recompute_granularity=recompute))
            activation_checkpointing.configure(partition_activations=partition)
            try:
                model(ids[:, :-1], labels=ids[:, 1:]).backward()
            finally:
                activation_checkpointing.configure()
            grads.append({name: p.grad for name, p in model.named_parameters() if "router" in name})
        for other, what in zip(grads[1:], ("recomputed", "recomputed, partitioned")):
            for name, grad in grads[0].items():
                torch.testing.assert_close(other[name], grad, rtol=1e-6, atol=1e-9,
                                           msg=f"{config_class.__name__} {what}: {name}")
