"""Documents packed in a sample (--reset-position-ids, --reset-attention-mask, --eod-mask-loss) at
every layout: TP=2 with SP, PP=2, DP=2 under ZeRO-3 with full recomputation, the Llama at PP=2
with selective recomputation, and context parallelism (CP=2: GPT's ring, the Llama's all-to-all,
documents crossing the chunks, the masked loss's tokens counted over the whole sequence) match the
single process over 10 steps, with the same tolerances as
the plain layouts (tests/distributed/test_model_parallel.py), and differ from the plain run (a
control: the flags change the training). Dropout 0 runs the per-document kernels (a dropout draw
inside torch's kernel differs per call); two cases with dropout 0.1 on layout-invariant masks run
the written-out attention with the per-document mask (the ring's: each block's part of it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megazero.data import write_indexed_dataset
from megazero.data.packing import DocumentPacking
from tests.distributed.test_model_parallel import INVARIANT, LOSS_RTOL, PARAM_ATOL, STEPS, _assert_losses, _config
from tests.training_helpers import FAMILY, NO_DROPOUT, PACKING, train

EOD = 255
PACKED = DocumentPacking(EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)

# (name, world, (TP, PP), model overrides, zero stage, micro-batch size, engine config extras)
LAYOUTS = [
    ("tp2_sp", 2, (2, 1), {"sequence_parallel": True}, 0, 8, {}),
    ("pp2", 2, (1, 2), {}, 0, 4, {}),
    ("dp2_zero3_full_recompute", 2, (1, 1), {"recompute_granularity": "full"}, 3, 4, {}),
    ("llama_pp2_selective", 2, (1, 2), {FAMILY: "llama", "recompute_granularity": "selective"}, 1, 4, {}),
    ("tp2_sp_dropout", 2, (2, 1), {"sequence_parallel": True, "dropout": 0.1}, 1, 8, INVARIANT),
    ("cp2_p2p", 2, (1, 1), {"context_parallel_size": 2}, 0, 8, {}),
    ("llama_cp2_a2a", 2, (1, 1), {FAMILY: "llama", "context_parallel_size": 2, "cp_comm_type": "a2a"}, 2, 8, {}),
    ("cp2_p2p_dropout", 2, (1, 1), {"context_parallel_size": 2, "dropout": 0.1}, 0, 8, INVARIANT),
]


@pytest.fixture(scope="module")
def documents_prefix(tmp_path_factory) -> str:
    """80 short documents (3 to 24 tokens of a learnable sequence), each ending with EOD: several
    documents in every 32-token sample."""
    rng = np.random.default_rng(0)
    docs = []
    for length in rng.integers(3, 25, size=80):
        doc = np.empty(int(length), dtype=np.uint16)
        doc[0] = rng.integers(0, 251)
        for i in range(1, len(doc) - 1):
            doc[i] = (3 * int(doc[i - 1]) + 1) % 251
        doc[-1] = EOD
        docs.append(doc)
    prefix = str(tmp_path_factory.mktemp("docs") / "docs")
    write_indexed_dataset(prefix, docs, np.uint16)
    return prefix


@pytest.fixture(scope="module")
def reference(pools, documents_prefix):
    """The single process at a micro-batch size, of the overrides' family and dropout (each run once)."""
    runs = {}

    def get(micro: int, overrides: dict, extra: dict, packing) -> dict:
        family = {k: v for k, v in overrides.items() if k in (FAMILY, "dropout")}
        key = (micro, tuple(sorted(family.items())), bool(extra), packing is None)
        if key not in runs:
            runs[key] = pools(1).run(train, _config(0, micro, **extra), documents_prefix, STEPS, 0, None, None, None,
                                     {**NO_DROPOUT, **family, PACKING: packing})[0]
        return runs[key]

    return get


@pytest.mark.parametrize("name,world,layout,overrides,stage,micro,extra", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_packed_documents_match_the_single_process(pools, reference, documents_prefix, name, world, layout, overrides,
                                                   stage, micro, extra):
    # the single process at the same micro-batch size (--eod-mask-loss averages per micro-batch, as Megatron)
    expected = reference(micro, overrides, extra, PACKED)
    results = pools(world).run(train, _config(stage, micro, **extra), documents_prefix, STEPS, 0, None, None, None,
                               {**NO_DROPOUT, **overrides, PACKING: PACKED}, layout)
    for rank_result in results:
        _assert_losses(expected["losses"], rank_result["losses"], LOSS_RTOL)
        for key, value in expected["params"].items():
            torch.testing.assert_close(rank_result["params"][key], value, rtol=0, atol=PARAM_ATOL, msg=key)
    assert expected["losses"][-1] < expected["losses"][0]
    if name in ("tp2_sp", "llama_pp2_selective"):  # the control: without the flags the run differs
        plain = reference(micro, overrides, extra, None)
        gaps = [abs(a - b) for a, b in zip(plain["losses"], expected["losses"])]
        assert max(gaps) > 1e-2, gaps
