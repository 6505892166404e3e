"""Expert parallelism in the engine: expert gradients over the expert-data-parallel group, ZeRO 1-3
partitions over it (with optimizer and parameter offload to nvme), the global gradient norm, and
checkpoints that load at another EP size and ZeRO stage.

The model is a toy written here (the MoE layer is megazero.moe's): a dense layer, a router whose
gate scales the expert output (so the router's gradient is real), E stacked expert matrices
tagged `megazero_expert` of which EP rank r holds [r * E/EP, (r + 1) * E/EP), and a head. Each
token goes to a fixed expert (its global index mod E), and the tokens travel to the rank of their
expert and back by a plain all_to_all. It has no dropout: the claim is about the reductions (a
dropout mask would be drawn per micro-batch, and the single process runs other micro-batches).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import megazero
from megazero import parallel_state
from megazero.checkpoint.consolidate import consolidate_fp32_state_dict
from megazero.zero import DataParallelState

E, D, TOKENS, BATCH, STEPS = 4, 16, 4, 8, 10
LOSS_RTOL, PARAM_ATOL = 1e-5, 2e-5
CLIP = 0.05  # below the toy's gradient norms: every step is clipped


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; its backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.args = (out_splits, in_splits, group)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group = ctx.args
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=group)
        return back, None, None, None


class ToyMoE(torch.nn.Module):
    """dense -> tanh -> h + gate * expert(h) -> head; experts split over `ep_group` (None: all here)."""

    def __init__(self, ep_group=None):
        super().__init__()
        torch.manual_seed(0)  # every layout builds the same model
        self.ep_group = ep_group
        ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        rank = dist.get_rank(ep_group) if ep_group is not None else 0
        self.local = E // ep
        self.dense = torch.nn.Linear(D, D)
        self.router = torch.nn.Linear(D, E)
        full = torch.randn(E, D, D) * 0.3
        self.experts = torch.nn.Parameter(full[rank * self.local:(rank + 1) * self.local].clone())
        self.experts.megazero_expert = True
        self.head = torch.nn.Linear(D, 1)

    def _experts(self, h: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Each token through its expert, on the EP rank that holds it."""
        order = torch.argsort(expert, stable=True)
        h, expert = h[order], expert[order]
        if self.ep_group is not None:
            ep = dist.get_world_size(self.ep_group)
            send = torch.bincount(expert // self.local, minlength=ep)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.ep_group)
            send, recv = send.tolist(), recv.tolist()
            h = _AllToAll.apply(h, recv, send, self.ep_group)
            expert = _AllToAll.apply(expert.float().unsqueeze(1), recv, send, self.ep_group).squeeze(1).long()
        out = torch.einsum("nd,nde->ne", h, self.experts[expert % self.local])
        if self.ep_group is not None:
            out = _AllToAll.apply(out, send, recv, self.ep_group)
        return out[torch.argsort(order)]

    def forward(self, x: torch.Tensor, y: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.dense(x.reshape(-1, D)))
        expert = expert.reshape(-1)
        gate = torch.softmax(self.router(h), dim=-1).gather(1, expert.unsqueeze(1))
        out = h + gate * self._experts(h, expert)
        return torch.nn.functional.mse_loss(self.head(out).view_as(y), y)


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, TOKENS, D, generator=g)
    y = torch.randn(BATCH, TOKENS, generator=g)
    expert = torch.arange(BATCH * TOKENS).view(BATCH, TOKENS) % E
    return x, y, expert


def _config(stage: int, micro: int, nvme: str | None = None) -> dict:
    """`nvme`: optimizer offload there (and, at stage 3, parameter offload too)."""
    zero = {"stage": stage, "reduce_bucket_size": 200}  # several buckets
    if stage == 3:  # every parameter partitioned (none kept whole), prefetched
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=10_000,
                    stage3_gather_16bit_weights_on_model_save=True)
    if nvme is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2}
        zero["sub_group_size"] = 300  # several sub-groups per state
        if stage == 3:
            zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 4, "buffer_size": 1024}
    return {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": micro,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "gradient_clipping": CLIP, "steps_per_print": 1000, "zero_optimization": zero}


def _engine(stage: int, ep: int | None, micro: int, nvme: str | None = None, init: bool = False):
    """ep None: no grid (the single process); else the grid with that EP size over the world.
    `init`: the model built under zero.Init (stage 3)."""
    grid = parallel_state.initialize_model_parallel(1, 1, ep) if ep is not None else None
    with megazero.zero.Init(enabled=init):
        model = ToyMoE(grid.ep_group if grid is not None else None)
    engine, *_ = megazero.initialize(model=model, config=_config(stage, micro, nvme),
                                     mpu=parallel_state if grid is not None else None)
    return engine


def _train(engine, steps: int, start: int = 0) -> dict:
    """`steps` optimizer steps over the global batches from `start`, this rank's slice of each."""
    dp, rank = engine.dp_world_size, engine.dp_rank
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses, norms = [], []
    for step in range(start, start + steps):
        x, y, expert = _global_batch(step)
        total = 0.0
        for m in range(accumulation):
            # micro-batch m of rank r: samples (m * dp + r) * micro onwards; every sample once per step
            at = slice((m * dp + rank) * micro, (m * dp + rank + 1) * micro)
            loss = engine(x[at], y[at], expert[at])
            engine.backward(loss)
            engine.step()
            total += loss.item() / accumulation
        mean = torch.tensor([total])
        if dist.get_world_size() > 1:
            dist.all_reduce(mean, group=engine.dp_group)
        losses.append(mean.item() / dp)
        norms.append(engine.last_grad_norm)
    return {"losses": losses, "norms": norms, "params": _full_params(engine)}


def _full_params(engine) -> dict[str, torch.Tensor]:
    """The whole model: the experts of every EP rank joined in global order (ZeRO-3: gathered by
    hand, over the expert-DP group, then the EP group, not through the state)."""
    out = {}
    for name, p in engine.module.named_parameters():
        shard = getattr(p, "_megazero_shard", None)
        if shard is None:
            out[name] = p.detach().clone()
            continue
        pieces = [torch.empty_like(shard.shard) for _ in range(shard.world_size)]
        dist.all_gather(pieces, shard.shard, group=shard.group)
        offset = shard.layout.offsets[p]
        out[name] = torch.cat(pieces)[offset:offset + shard.layout.numels[p]].view(shard.layout.shapes[p]).clone()
    group = engine.module.ep_group
    if group is not None:
        pieces = [torch.empty_like(out["experts"]) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, out["experts"].contiguous(), group=group)
        out["experts"] = torch.cat(pieces)
    return out


def run_reference() -> dict:
    """The single process on the whole global batch (ZeRO 0, no grid)."""
    return _train(_engine(0, None, BATCH), STEPS)


def _expert_partition_group(engine):
    """The process group the expert parameters' ZeRO partitions are cut over."""
    state = engine.dp.expert
    return getattr(state, "inner", state).group


def run_layouts(ep: int, micro: int, nvme: str) -> dict:
    """ZeRO 0-3 at this EP size (DP = the world); stages 2 and 3 with offload to nvme (3: the
    parameters too, the model built under zero.Init)."""
    out = {}
    for stage in (0, 1, 2, 3):
        engine = _engine(stage, ep, micro)
        assert isinstance(engine.dp, DataParallelState) and engine.dp.stage == stage
        out[stage] = _train(engine, STEPS)
        if stage == 3:  # experts over the expert-DP group, never gathered over another EP rank's
            assert _expert_partition_group(engine) is parallel_state.get_expert_data_parallel_group()
    for stage in (2, 3):
        engine = _engine(stage, ep, micro, nvme=os.path.join(nvme, str(stage)), init=stage == 3)
        assert type(engine.optimizer).__name__ == "OffloadedOptimizer" and len(engine.optimizer.offloads) == 2
        out[f"{stage}_nvme"] = _train(engine, STEPS)
    return out


def _assert_same_run(ref: dict, other: dict, what: str) -> None:
    for step, (a, b) in enumerate(zip(ref["losses"], other["losses"], strict=True)):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"{what} step {step}: loss {a} vs {b}"
    for step, (a, b) in enumerate(zip(ref["norms"], other["norms"], strict=True)):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"{what} step {step}: gradient norm {a} vs {b}"
    for name, p in ref["params"].items():
        torch.testing.assert_close(other["params"][name], p, rtol=0, atol=PARAM_ATOL, msg=f"{what}: {name}")


@pytest.fixture(scope="module")
def reference(pools):
    ref = pools(1).run(run_reference)[0]
    assert min(ref["norms"]) > CLIP and ref["losses"][-1] < ref["losses"][0]
    return ref


@pytest.mark.parametrize("world_size, micro", [(2, 2), (4, 1)])  # 2 accumulated micro-batches per step
def test_expert_parallel_matches_single_process(pools, reference, world_size, micro, tmp_path):
    results = pools(world_size).run(run_layouts, 2, micro, str(tmp_path))
    for rank, result in enumerate(results):
        for stage in (0, 1, 2, 3, "2_nvme", "3_nvme"):
            _assert_same_run(reference, result[stage], f"DP={world_size} EP=2 ZeRO-{stage} rank {rank}")


def run_checkpoint_recut(save_dir: str, stage: int, nvme: str | None) -> dict:
    """Save at EP=2, load at EP=1 (and the same layout, and EP=1 at another ZeRO stage without
    offload), save there, load at EP=2: each load continues exactly as the run that saved it."""
    a = _engine(stage, 2, 2, nvme)
    saved = _train(a, 3)["params"]
    a.save_checkpoint(save_dir, "ep2")
    a.save_16bit_model(save_dir, "model.pt")  # the whole model: experts gathered over the EP group
    out = {"saved": saved}
    if dist.get_rank() == 0:
        out["consolidated"] = consolidate_fp32_state_dict(save_dir, "ep2")  # all experts, global order
        out["16bit"] = torch.load(os.path.join(save_dir, "model.pt"), weights_only=True)
    out["a_next"] = _train(a, 2, start=3)
    other = 1 if stage == 3 else 3
    for name, ep, at_stage, offload in (("ep1", 1, stage, nvme), ("ep2_again", 2, stage, nvme),
                                         (f"ep1_stage{other}", 1, other, None)):
        b = _engine(at_stage, ep, 2, offload)
        b.load_checkpoint(save_dir, "ep2")
        out[name] = _train(b, 2, start=3)
        if name == "ep2_again":
            b.save_checkpoint(save_dir, "ep2_again")  # b is at EP=2 here: save from EP=1 next
    c = _engine(stage, 1, 2, nvme)
    c.load_checkpoint(save_dir, "ep2_again")
    c.save_checkpoint(save_dir, "ep1")
    d = _engine(stage, 2, 2, nvme)
    d.load_checkpoint(save_dir, "ep1")
    out["ep1_to_ep2"] = _train(d, 1, start=5)
    out["c_next"] = _train(c, 1, start=5)
    return out


@pytest.mark.parametrize("stage, world_size, nvme", [(0, 2, False), (2, 2, False), (3, 4, True)])
def test_checkpoint_loads_at_another_ep_size(pools, tmp_path, stage, world_size, nvme):
    """ZeRO-3 at EP=2 x expert-DP=2, its states on nvme: saved, loaded at EP 1 and 2 and at stage 1."""
    results = pools(world_size).run(run_checkpoint_recut, str(tmp_path / "ckpt"), stage,
                                    str(tmp_path / "nvme") if nvme else None)
    for name, whole in results[0]["saved"].items():
        assert whole.shape[0] == E or name != "experts"
        torch.testing.assert_close(results[0]["consolidated"][name], whole, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(results[0]["16bit"][name], whole, rtol=0, atol=0, msg=name)
    other = 1 if stage == 3 else 3
    for rank, result in enumerate(results):
        for name in ("ep1", "ep2_again", f"ep1_stage{other}"):
            _assert_same_run(result["a_next"], result[name], f"ZeRO-{stage} EP=2 -> {name} rank {rank}")
        _assert_same_run(result["c_next"], result["ep1_to_ep2"], f"ZeRO-{stage} EP=1 -> EP=2 rank {rank}")
