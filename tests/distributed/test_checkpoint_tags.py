"""DeepSpeed's checkpoint tutorial snippet, unmodified, on 2 gloo ranks: float tags (each rank's own
loss), rank 0's tag on every rank, checkpoint.tag_validation Warn / Ignore / Fail, and an exact
continuation from `latest` and from an explicit tag, with dropout on."""

from __future__ import annotations

import argparse
import os
import warnings

import pytest
import torch

from megazero.checkpoint import CheckpointError
from megazero.checkpoint.io import check_tag
from megazero.config import ConfigError, parse_config
from tests.deepspeed_helpers import build_tiny, tiny_config


def deepspeed_tutorial(config: dict, save_dir: str, load_dir: str | None, ckpt_id, stop: int) -> dict:
    """DeepSpeed's "Model Checkpointing" loop as its tutorial writes it, run until step `stop`.

    The tutorial advances its data loader with its own `dataloader_to_step(data_loader, step + 1)`;
    megazero's loader already resumes at the checkpoint's sample, so the loop only starts counting
    its steps there."""
    args = argparse.Namespace(save_dir=save_dir, load_dir=load_dir, ckpt_id=ckpt_id, save_interval=3)
    model_engine, data_loader = build_tiny(config, args=args)
    client_sd, start = {}, 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if args.load_dir is not None:
            # load checkpoint
            _, client_sd = model_engine.load_checkpoint(args.load_dir, args.ckpt_id)
            step = client_sd['step']
            start = step + 1
        losses, tags = [], []
        for step, batch in enumerate(data_loader, start):
            if step == stop:
                break
            # forward() method
            loss = model_engine(batch)
            # runs backpropagation
            model_engine.backward(loss)
            # weight update
            model_engine.step()
            losses.append(loss.item())
            # save checkpoint
            if step % args.save_interval:
                client_sd['step'] = step
                ckpt_id = loss.item()
                model_engine.save_checkpoint(args.save_dir, ckpt_id, client_state=client_sd)
                tags.append(ckpt_id)
    messages = [str(w.message) for w in caught if "checkpoint tag" in str(w.message)]
    return {"losses": losses, "tags": tags, "tag_warnings": messages}


@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_tutorial_snippet_resumes_exactly(pools, tmp_path, stage):
    pool = pools(2)
    config = tiny_config(stage)
    full = pool.run(deepspeed_tutorial, config, str(tmp_path / "full"), None, None, 6)
    # each rank's loss differs, so each rank passes its own tag: rank 0's names the checkpoint
    assert all(a != b for a, b in zip(full[0]["tags"], full[1]["tags"]))
    assert sorted(os.listdir(tmp_path / "full")) == sorted([str(t) for t in full[0]["tags"]] + ["latest"])
    assert (tmp_path / "full" / "latest").read_text() == str(full[0]["tags"][-1])
    for tag in full[0]["tags"]:  # rank 1 wrote its files into rank 0's directory
        assert (tmp_path / "full" / str(tag) / "rng_state_rank1.pt").is_file()
    warned = full[0]["tag_warnings"]
    assert len(warned) == len(full[0]["tags"]) and all("rank 1" in m for m in warned), warned
    assert full[1]["tag_warnings"] == []  # one warning per save, from rank 0

    part = pool.run(deepspeed_tutorial, config, str(tmp_path / "part"), None, None, 3)
    assert [p["losses"] for p in part] == [f["losses"][:3] for f in full]
    from_latest = pool.run(deepspeed_tutorial, config, str(tmp_path / "resumed"), str(tmp_path / "part"), None, 6)
    assert [r["losses"] for r in from_latest] == [f["losses"][3:] for f in full], \
        "resuming from latest does not continue the uninterrupted run's losses"
    float_tag = part[0]["tags"][-1]  # rank 0's loss, a float, as the tutorial's args.ckpt_id
    assert isinstance(float_tag, float)
    by_tag = pool.run(deepspeed_tutorial, config, str(tmp_path / "again"), str(tmp_path / "part"), float_tag, 6)
    assert [r["losses"] for r in by_tag] == [f["losses"][3:] for f in full]


def _save_own_loss_tag(config: dict, save_dir: str):
    engine, loader = build_tiny(config)
    loss = engine(next(iter(loader)))
    engine.backward(loss)
    engine.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            engine.save_checkpoint(save_dir, loss.item())
            outcome = "saved"
        except CheckpointError as e:
            outcome = f"error: {e}"
    return {"tag": str(loss.item()), "outcome": outcome,
            "warnings": [str(w.message) for w in caught if "checkpoint tag" in str(w.message)]}


def test_tag_validation_fail_raises_on_every_rank_naming_the_ranks(pools, tmp_path):
    config = tiny_config(0, checkpoint={"tag_validation": "fail"})  # case-insensitive, as DeepSpeed
    results = pools(2).run(_save_own_loss_tag, config, str(tmp_path))
    for result in results:
        assert result["outcome"].startswith("error: checkpoint tag differs across ranks"), result
        assert f"rank 1 '{results[1]['tag']}'" in result["outcome"] and results[0]["tag"] in result["outcome"]
    assert not tmp_path.exists() or os.listdir(tmp_path) == []


def test_tag_validation_ignore_uses_rank_0_tag_silently(pools, tmp_path):
    results = pools(2).run(_save_own_loss_tag, tiny_config(0, checkpoint={"tag_validation": "Ignore"}),
                           str(tmp_path))
    assert [r["outcome"] for r in results] == ["saved", "saved"]
    assert [r["warnings"] for r in results] == [[], []]
    tag = results[0]["tag"]
    assert results[1]["tag"] != tag
    assert sorted(os.listdir(tmp_path)) == sorted([tag, "latest"])
    assert sorted(os.listdir(tmp_path / tag)) == ["manifest.json", "mp_rank_00_model_states.pt",
                                                  "mp_rank_00_optim_states.pt", "rng_state_rank0.pt",
                                                  "rng_state_rank1.pt"]


def test_tag_validation_config():
    assert parse_config({"train_batch_size": 1}, 1).checkpoint.tag_validation == "WARN"
    for given, stored in (("Warn", "WARN"), ("ignore", "IGNORE"), ("FAIL", "FAIL")):
        config = parse_config({"train_batch_size": 1, "checkpoint": {"tag_validation": given}}, 1)
        assert config.checkpoint.tag_validation == stored
    with pytest.raises(ConfigError, match=r"'checkpoint.tag_validation' must be one of Warn, Ignore, Fail"):
        parse_config({"train_batch_size": 1, "checkpoint": {"tag_validation": "strict"}}, 1)
    with pytest.raises(ConfigError, match=r"unknown key 'checkpoint.tag_validaton'"):
        parse_config({"train_batch_size": 1, "checkpoint": {"tag_validaton": "Warn"}}, 1)


def test_any_tag_str_prints_is_accepted():
    assert check_tag(2.3125) == "2.3125"
    assert check_tag(0.0) == "0.0"  # a falsy tag is still the tag, not the default
    assert check_tag(torch.tensor(1.5).item()) == "1.5"
    assert check_tag("global_step10") == "global_step10"
    assert check_tag("epoch 3 loss=1.2e-05") == "epoch 3 loss=1.2e-05"
    for bad in ("a/b", "", ".hidden", "latest", " padded", "two\nlines"):
        with pytest.raises(CheckpointError, match="invalid checkpoint tag"):
            check_tag(bad)


def _load_own_tag(config: dict, load_dir: str, tags: list) -> dict:
    import torch.distributed as dist

    engine, _ = build_tiny(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, client = engine.load_checkpoint(load_dir, tags[dist.get_rank()])
    return {"path": path, "step": client["step"],
            "warnings": [str(w.message) for w in caught if "checkpoint tag" in str(w.message)]}


def test_load_uses_rank_0_tag(pools, tmp_path):
    pool = pools(2)
    config = tiny_config(0)
    part = pool.run(deepspeed_tutorial, config, str(tmp_path), None, None, 3)
    own = [part[0]["tags"][-1], part[1]["tags"][-1]]  # each rank's own last loss; only rank 0's was saved
    loaded = pool.run(_load_own_tag, config, str(tmp_path), own)
    assert [r["path"] for r in loaded] == [str(tmp_path / str(own[0]))] * 2
    assert [r["step"] for r in loaded] == [2, 2]
    assert len(loaded[0]["warnings"]) == 1 and f"rank 1 '{own[1]}'" in loaded[0]["warnings"][0]


def _save_to_own_dir(config: dict, base: str) -> str:
    import torch.distributed as dist

    engine, _ = build_tiny(config)
    try:
        engine.save_checkpoint(os.path.join(base, f"rank{dist.get_rank()}"), "same")
    except CheckpointError as e:
        return str(e)
    return "saved"


def test_a_rank_that_cannot_see_rank_0_directory_fails_on_every_rank(pools, tmp_path):
    errors = pools(2).run(_save_to_own_dir, tiny_config(0), str(tmp_path))
    for error in errors:
        assert error.startswith("ranks [1] cannot see the checkpoint directory") and "rank0/.same.tmp that" in error
        assert "rank 1 looked for" in error and "rank1/.same.tmp" in error
    assert not (tmp_path / "rank1").exists()  # rank 1 wrote nothing anywhere
