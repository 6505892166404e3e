"""BERT recomputation and sequence parallelism (models/bert.py, the BERT recipe's flags): recompute
keeps fewer activation bytes with gradients bit-equal to none (dropout on), also under TP=2 + SP;
TP=2 + SP trains as the single process (dropout on, layout-invariant masks)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import megazero.activation_checkpointing as ac
from megazero import parallel_state, tensor_parallel
from megazero.profiling.memory import ActivationMeter
from models.bert import BertConfig
from models.parallelize import parallelize
from tests.bert_helpers import TINY_BERT, bert_dataset, train_bert, write_sentence_dataset
from tests.training_helpers import base_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DROPOUT = TINY_BERT  # dropout 0.1: the recompute tests compare fixed masks


@pytest.fixture(scope="module")
def sentence_prefix(tmp_path_factory) -> str:
    return write_sentence_dataset(str(tmp_path_factory.mktemp("sentences") / "sentences"))


def _batch(prefix: str) -> dict:
    dataset = bert_dataset(prefix)
    samples = [dataset[i] for i in range(4)]
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}


def _gradients(prefix: str, overrides: dict, tp: int = 1) -> dict:
    """Gradients and kept activation bytes of one forward/backward (dropout on, fixed masks)."""
    grid = parallel_state.initialize_model_parallel(tp, 1) if tp > 1 else None
    torch.manual_seed(0)
    model = parallelize(BertConfig(**{**DROPOUT, **overrides, "tensor_model_parallel_size": tp}), grid)
    tensor_parallel.model_parallel_seed(2, grid.tp_rank if grid else 0)  # the dropout masks
    ac.configure(parallel_state if grid else None)
    try:
        with ActivationMeter() as meter:
            loss = model(**_batch(prefix))
        loss.backward()
        stats = ac.checkpoint_stats()
    finally:
        ac.configure()
    return {"grads": {n: p.grad.clone() for n, p in model.named_parameters()}, "kept": meter.bytes,
            "recomputes": stats["recomputes"], "loss": loss.item()}


@pytest.mark.parametrize("overrides", [{"recompute_granularity": "full"},
                                       {"recompute_granularity": "full", "recompute_num_layers": 1},
                                       {"recompute_granularity": "selective"},
                                       {"recompute_granularity": "full", "post_layer_norm": False}])
def test_recompute_is_bit_exact_and_keeps_less(sentence_prefix, overrides):
    base = {k: v for k, v in overrides.items() if not k.startswith("recompute")}
    plain = _gradients(sentence_prefix, base)
    other = _gradients(sentence_prefix, overrides)
    assert [n for n, g in plain["grads"].items() if not torch.equal(g, other["grads"][n])] == []
    assert other["recomputes"] == overrides.get("recompute_num_layers", TINY_BERT["num_layers"])
    assert plain["recomputes"] == 0
    if overrides["recompute_granularity"] == "full":  # one of the two layers: about a quarter less
        assert other["kept"] < plain["kept"] * (0.75 if "recompute_num_layers" in overrides else 0.5)
    else:  # dropout on: the CPU attention keeps its seq x seq probabilities unless recomputed
        assert other["kept"] < plain["kept"]


def test_dropout_makes_the_masks_matter(sentence_prefix):
    """Bit-equality above is meaningful: the same model with dropout off has other gradients."""
    on = _gradients(sentence_prefix, {})
    off = _gradients(sentence_prefix, {"dropout": 0.0})
    assert not all(torch.equal(g, off["grads"][n]) for n, g in on["grads"].items())


def _sp_recompute(prefix: str, recompute: str | None) -> dict:
    return _gradients(prefix, {"sequence_parallel": True, "recompute_granularity": recompute}, tp=2)


def test_sequence_parallel_recompute_is_bit_exact_at_tp2(pools, sentence_prefix):
    for plain, other in zip(pools(2).run(_sp_recompute, sentence_prefix, None),
                            pools(2).run(_sp_recompute, sentence_prefix, "full")):
        assert [n for n, g in plain["grads"].items() if not torch.equal(g, other["grads"][n])] == []
        assert other["recomputes"] == TINY_BERT["num_layers"] and other["kept"] < plain["kept"] / 2


STEPS = 4
# dropout 0.1 (TINY_BERT's) on per-sample masks, which TP + SP and the pipeline draw as one process does
INVARIANT = {"dropout_masks": {"layout_invariant": True}}


@pytest.mark.parametrize("post_layer_norm, layout, micro", [(True, (2, 1), 8), (False, (2, 1), 8),
                                                          (True, (2, 2), 2)])
def test_tp2_sequence_parallel_matches_single_process(pools, sentence_prefix, post_layer_norm, layout, micro):
    """TP=2 + SP (and TP=2 x PP=2 + SP: the stages pass sequence slices) against one process at the
    same micro-batch size (the losses are means over a micro-batch's masked tokens), dropout on.
    Both draw layout-invariant masks (per sample, per global head; under SP a rank keeps its slice
    of the whole sequence's mask): in the default mode each rank draws its own masks for its part of
    the sequence (as Megatron does), so no single-process run would have the same masks."""
    config = base_config(train_micro_batch_size_per_gpu=micro, **INVARIANT)
    model = {"post_layer_norm": post_layer_norm}
    reference = pools(1).run(train_bert, config, sentence_prefix, STEPS, None, model)[0]
    for result in pools(layout[0] * layout[1]).run(train_bert, config, sentence_prefix, STEPS, layout,
                                                   {**model, "sequence_parallel": True}):
        for a, b in zip(reference["losses"], result["losses"]):
            assert abs(a - b) <= 1e-5 * abs(a), (reference["losses"], result["losses"])
        for key, value in reference["params"].items():
            torch.testing.assert_close(result["params"][key], value, rtol=0, atol=2e-5, msg=key)


def test_recipe_flags_reach_the_model():
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import pretrain_bert

    from megazero.config.cli import model_config_of, parse_run

    def config_of(*flags: str) -> BertConfig:
        run = parse_run(pretrain_bert.BertRun, ["--data-path", "unused", *flags], pretrain_bert.RUN_FILE)
        return model_config_of(run, BertConfig, 8000)

    config = config_of("--recompute-granularity", "full", "--recompute-num-layers", "2", "--sequence-parallel",
                       "--tensor-model-parallel-size", "2")
    assert (config.recompute_granularity, config.recompute_num_layers, config.sequence_parallel,
            config.tensor_model_parallel_size) == ("full", 2, True, 2)
    defaults = config_of()
    assert (defaults.recompute_granularity, defaults.recompute_num_layers, defaults.sequence_parallel) == (
        None, None, False)
    assert config_of("--pre-layer-norm").post_layer_norm is False and defaults.post_layer_norm is True


def test_recompute_num_layers_without_full_is_an_error():
    with pytest.raises(ValueError, match="recompute_num_layers 2 needs recompute_granularity 'full'"):
        BertConfig(**TINY_BERT, recompute_num_layers=2)
