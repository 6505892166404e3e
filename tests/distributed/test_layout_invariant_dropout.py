"""The layout-invariant dropout mode (`dropout_masks.layout_invariant`): with dropout 0.1, the
layouts that cannot match the single process in the default mode do.

- TP=2 (+ SP, full recompute) and TP=2 x PP=2 with v=2 (interleaved, selective recompute, 2
  micro-batches of 4) against the single process taking the global batch of 8 as one micro-batch:
  in the default mode a TP rank draws its attention heads' masks (and its sequence shard's under
  SP) from its own tracker, and a micro-batch of other samples draws other masks; here every mask
  is a function of the sample (and the global head), so all three draw the same.
- The MoE GPT at EP=2 on DP=2 (capacity mode: tokens dropped) against the single process running
  the EP group's samples as one micro-batch, which it must for the router to see the same tokens
  together (tests/distributed/test_model_parallel.py and test_moe_engine.py say why the default
  mode cannot).
10 steps, fp32: losses within 1e-5 relative, weights within 2e-5, the same MoE drops. The unit tests
below check the masks themselves: the default mode draws what it drew before, the invariant mode
draws other masks, per sample, per global head and per sequence slice.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import megazero
from megazero import parallel_state
from megazero.moe import moe_stats
from megazero.tensor_parallel import invariant_dropout as keyed
from megazero.tensor_parallel.random import MicroBatchStreams, layer_stream
from models.gpt import Block, CausalAttention, GPTConfig
from models.parallelize import parallelize
from tests.training_helpers import LAYERS_PER_VIRTUAL_STAGE, base_config, train

STEPS, LOSS_RTOL, PARAM_ATOL, P = 10, 1e-5, 2e-5, 0.1
INVARIANT = {"dropout_masks": {"layout_invariant": True}}
MODEL = {"num_layers": 4, "hidden_size": 32}  # TINY's 4 heads, dropout 0.1; 4 layers for PP=2 x v=2


def _assert_matches(reference: dict, result: dict, what: str) -> None:
    assert len(result["losses"]) == len(reference["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(reference["losses"], result["losses"])):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"{what} step {step}: loss {a} vs {b}"
    assert result["params"].keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        torch.testing.assert_close(result["params"][name], value, rtol=0, atol=PARAM_ATOL, msg=f"{what}: {name}")


@pytest.fixture(scope="module")
def reference(pools, token_dataset_prefix_module):
    """The single process: the global batch of 8 as one micro-batch."""
    config = base_config(train_micro_batch_size_per_gpu=8, **INVARIANT)
    result = pools(1).run(train, config, token_dataset_prefix_module, STEPS, 0, None, None, None, MODEL)[0]
    assert result["losses"][-1] < result["losses"][0], result["losses"]
    return result


def test_tensor_parallel_matches_single_process_with_dropout(pools, reference, token_dataset_prefix_module):
    config = base_config(train_micro_batch_size_per_gpu=8, **INVARIANT)
    overrides = {**MODEL, "sequence_parallel": True, "recompute_granularity": "full"}
    for rank, result in enumerate(pools(2).run(train, config, token_dataset_prefix_module, STEPS, 0, None, None,
                                               None, overrides, (2, 1))):
        _assert_matches(reference, result, f"TP=2 + SP rank {rank}")


def test_interleaved_tp_pp_matches_single_process_with_dropout(pools, reference, token_dataset_prefix_module):
    config = base_config(train_micro_batch_size_per_gpu=4, **INVARIANT)  # 2 micro-batches per step
    overrides = {**MODEL, LAYERS_PER_VIRTUAL_STAGE: 1, "recompute_granularity": "selective"}
    for rank, result in enumerate(pools(4).run(train, config, token_dataset_prefix_module, STEPS, 0, None, None,
                                               None, overrides, (2, 2))):
        _assert_matches(reference, result, f"TP=2 x PP=2 x v=2 rank {rank}")


# ---- MoE: EP=2 on DP=2 against the single process on the EP group's samples as one micro-batch ----
MOE_VOCAB, MOE_SEQ, MOE_BATCH = 64, 16, 4


def _moe_engine(ep: int | None, micro: int, optimizer: dict | None, zero: dict):
    grid = parallel_state.initialize_model_parallel(1, 1, ep) if ep is not None else None
    torch.manual_seed(0)
    model = parallelize(GPTConfig(vocab_size=MOE_VOCAB, seq_length=MOE_SEQ, num_layers=2, hidden_size=32,
                                  num_attention_heads=2, make_vocab_size_divisible_by=16, num_experts=4,
                                  moe_router_topk=2, moe_capacity_factor=1.0, dropout=P), grid)
    config = {"train_batch_size": MOE_BATCH, "train_micro_batch_size_per_gpu": micro,
              "optimizer": optimizer or {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
              "gradient_clipping": 1.0, "steps_per_print": 1000, "zero_optimization": zero, **INVARIANT}
    engine, *_ = megazero.initialize(model=model, config=config, mpu=parallel_state if grid is not None else None)
    return engine


def _moe_steps(engine, steps: range, losses: list, stats: list) -> None:
    dp, micro, rank = engine.dp_world_size, engine.train_micro_batch_size_per_gpu(), engine.dp_rank
    for step in steps:
        ids = torch.randint(0, MOE_VOCAB, (MOE_BATCH, MOE_SEQ + 1), generator=torch.Generator().manual_seed(step))
        total = torch.zeros(())
        for m in range(engine.gradient_accumulation_steps()):  # micro-batch m of rank r: (m * dp + r) * micro on
            at = slice((m * dp + rank) * micro, (m * dp + rank + 1) * micro)
            loss = engine(ids[at, :-1], labels=ids[at, 1:])
            engine.backward(loss)
            engine.step()
            total += loss.detach() / engine.gradient_accumulation_steps()
        if dp > 1:
            dist.all_reduce(total, group=engine.dp_group)
        losses.append(total.item() / dp)
        stats.append(moe_stats(engine.module))


def run_moe(ep: int | None, optimizer: dict | None = None, zero: dict | None = None, ep_groups: int = 1,
            resume_dir: str | None = None) -> dict:
    """The MoE GPT (4 experts, top-2, capacity factor 1.0, dropout 0.1) for 10 steps on this DP
    rank's slice of each global batch; ep None: the single process, the global batch as `ep_groups`
    micro-batches (one per EP group of the layout it stands for: the router of an EP group sees
    its samples together). `optimizer`: the engine config's block (default AdamW); `zero`: its
    zero_optimization (default stage 2); `resume_dir`: saved there after 5 steps and continued by
    a new engine that loads it."""
    dp = dist.get_world_size() if ep is not None else 1
    micro = MOE_BATCH // dp if ep is not None else MOE_BATCH // ep_groups
    zero = zero or {"stage": 2}
    engine = _moe_engine(ep, micro, optimizer, zero)
    losses, stats = [], []
    if resume_dir is None:
        _moe_steps(engine, range(STEPS), losses, stats)
    else:
        _moe_steps(engine, range(STEPS // 2), losses, stats)
        engine.save_checkpoint(resume_dir, "half")
        engine = _moe_engine(ep, micro, optimizer, zero)
        engine.load_checkpoint(resume_dir, "half")
        _moe_steps(engine, range(STEPS // 2, STEPS), losses, stats)
    group = engine.module.blocks[0].mlp.ep_group
    params = {}
    named = list(engine.module.named_parameters())
    with megazero.zero.GatheredParameters([p for _, p in named]):  # (ZeRO-3: the units made whole)
        for name, param in named:
            p = param.detach().clone()
            if getattr(param, "megazero_expert", False) and group is not None:  # experts in global order
                pieces = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
                dist.all_gather(pieces, p.contiguous(), group=group)
                p = torch.cat(pieces)
            params[name] = p
    out = {"losses": losses, "stats": stats, "params": params}
    if zero["stage"] == 3:  # the expert units' gathers started ahead of use
        expert = engine.dp.expert
        out["expert_prefetches"] = getattr(expert, "inner", expert).prefetches
    return out


def test_moe_expert_parallel_matches_single_process_with_dropout(pools):
    reference = pools(1).run(run_moe, None)[0]
    dropped = [s["dropped_fraction"] for s in reference["stats"]]
    assert max(dropped) > 0, f"capacity mode drops no tokens: {dropped}"
    for rank, result in enumerate(pools(2).run(run_moe, 2)):
        _assert_matches(reference, result, f"EP=2 rank {rank}")
        for step, (a, b) in enumerate(zip(reference["stats"], result["stats"])):
            assert a["dropped_fraction"] == b["dropped_fraction"], f"EP=2 rank {rank} step {step}: {a} vs {b}"


ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2000,
         "stage3_prefetch_bucket_size": 100_000}


def test_moe_zero3_ep2_dp2_with_nvme_offload_matches_single_process_and_resumes(pools, tmp_path):
    """EP=2 x expert-DP=2 (4 ranks) at ZeRO-3, in memory and with optimizer and parameter offload to
    nvme (saved after 5 steps, resumed by a new engine): the single process's run."""
    reference = pools(1).run(run_moe, None, None, {"stage": 0}, 2)[0]
    nvme = {**ZERO3, "sub_group_size": 5000,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme"), "buffer_count": 2},
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "nvme"), "buffer_count": 8,
                              "buffer_size": 20_000}}
    runs = {"ZeRO-3": pools(4).run(run_moe, 2, None, ZERO3),
            "ZeRO-3 + nvme, resumed": pools(4).run(run_moe, 2, None, nvme, 1, str(tmp_path / "ckpt"))}
    for what, results in runs.items():
        for rank, result in enumerate(results):
            _assert_matches(reference, result, f"EP=2 x DP=2 {what} rank {rank}")
            assert result["expert_prefetches"] > 0, f"{what} rank {rank}: no expert unit was prefetched"


# ---- the masks themselves (one process) ------------------------------------------------------------
def _invariant(first: int, rows: int, tp_rank: int = 0, tp_size: int = 1, step: int = 3):
    streams = MicroBatchStreams(7, tp_rank=tp_rank, tp_size=tp_size, layout_invariant=True)
    return streams.micro_batch(step, 0, range(first, first + rows))


def test_default_mode_unchanged_and_invariant_mode_differs():
    torch.manual_seed(0)
    block = Block(GPTConfig(vocab_size=64, seq_length=16, num_layers=2, hidden_size=32, num_attention_heads=4,
                            dropout=P), layer=1).train()
    x = torch.randn(4, 16, 32)
    q, k, v = (torch.randn(4, 4, 16, 8) for _ in range(3))
    default = MicroBatchStreams(7)
    with default.micro_batch(3, 1, range(4, 8)):
        layer_stream(1)
        drawn = block._dropout(x, keyed.MLP_OUTPUT)
        attended = block.attn.core(q, k, v)
    # the default path is the one before the mode existed: F.dropout / SDPA on the layer's stream
    torch.manual_seed(default.layer_seeds(3, 1, 1)[0])
    assert torch.equal(drawn, F.dropout(x, P, True))
    assert torch.equal(attended, F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=P))
    with _invariant(4, 4):
        keyed_drawn, keyed_attended = block._dropout(x, keyed.MLP_OUTPUT), block.attn.core(q, k, v)
        again = block._dropout(x, keyed.MLP_OUTPUT)
        other_site = block._dropout(x, keyed.ATTENTION_OUTPUT)
    assert torch.equal(keyed_drawn, again)  # a function of the keys, not of a running generator
    for a, b in ((keyed_drawn, drawn), (keyed_attended, attended), (keyed_drawn, other_site)):
        assert not torch.equal(a, b)
    dropped = (keyed_drawn == 0).float().mean().item()
    assert 0.05 < dropped < 0.15, dropped  # bernoulli(0.9) masks, kept elements scaled by 1 / 0.9
    torch.testing.assert_close(keyed_drawn[keyed_drawn != 0], x[keyed_drawn != 0] / 0.9)
    with default.micro_batch(0, 0), pytest.raises(RuntimeError, match="outside a layout-invariant"):
        keyed.hidden_dropout(x, P, 0, keyed.EMBEDDING)
    with _invariant(0, 2), pytest.raises(ValueError, match="has 4 rows, but the engine numbered 2"):
        keyed.hidden_dropout(x, P, 0, keyed.EMBEDDING)


def test_invariant_masks_per_sample_head_and_sequence_slice():
    torch.manual_seed(0)
    x = torch.randn(4, 16, 8)
    q, k, v = torch.randn(4, 4, 16, 8), torch.randn(4, 2, 16, 8), torch.randn(4, 2, 16, 8)  # 2 key/value groups
    with _invariant(4, 4):  # samples 4..7 of the global batch, the whole model on one rank
        hidden = keyed.hidden_dropout(x, P, 2, keyed.MLP_OUTPUT)
        attended = keyed.attention(q, k, v, P, 2, is_causal=True)
    for row in range(4):  # each sample alone, as a micro-batch of one
        with _invariant(4 + row, 1):
            assert torch.equal(keyed.hidden_dropout(x[row:row + 1], P, 2, keyed.MLP_OUTPUT), hidden[row:row + 1])
            torch.testing.assert_close(keyed.attention(q[row:row + 1], k[row:row + 1], v[row:row + 1], P, 2,
                                                       is_causal=True), attended[row:row + 1], rtol=0, atol=1e-6)
    with _invariant(4, 4, tp_rank=1, tp_size=2):  # TP rank 1 of 2: query heads 2, 3 (key/value group 1)
        torch.testing.assert_close(keyed.attention(q[:, 2:], k[:, 1:], v[:, 1:], P, 2, is_causal=True),
                                   attended[:, 2:], rtol=0, atol=1e-6)
        assert torch.equal(keyed.hidden_dropout(x, P, 2, keyed.MLP_OUTPUT), hidden)  # replicated activations
        assert torch.equal(keyed.hidden_dropout(x[:, 8:], P, 2, keyed.MLP_OUTPUT, sequence_parallel=True),
                           hidden[:, 8:])  # its slice of the sequence
    # without dropping (p = 0) the unfused attention is SDPA's, causal and with a padding mask
    attend = torch.rand(4, 1, 1, 16) > 0.3
    attend[..., 0] = True
    with _invariant(0, 4):
        torch.testing.assert_close(keyed.attention(q, k, v, 0.0, 0, is_causal=True),
                                   F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        torch.testing.assert_close(keyed.attention(q, k, v, 0.0, 0, attn_mask=attend),
                                   F.scaled_dot_product_attention(q, k, v, attn_mask=attend, enable_gqa=True))


def test_causal_attention_core_keys_by_its_layer():
    """The core recomputed alone (selective recomputation) keys by the layer it was built for."""
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    with _invariant(0, 2):
        first, same, other = (CausalAttention(P, layer).train()(q, k, v) for layer in (0, 0, 1))
    assert torch.equal(first, same) and not torch.equal(first, other)
