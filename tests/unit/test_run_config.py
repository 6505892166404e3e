"""The run config tree (megazero/config/run.py) and its generated command line (megazero/config/cli.py):
flags from fields, Megatron's spellings, one setting in two spellings refused, flags over the engine
JSON (and said so), Megatron's LR schedule and batch ramp-up, a setting added to the tree reaching
--help, the printed config and the saved one with no other edit."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megazero.config.cli import describe, model_section, parse_run
from megazero.config.run import BatchRampup, RunConfig, RunSection, SampleSection
from megazero.optim.lr_schedules import MegatronLR
from models.gpt import GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_FILE = os.path.join(REPO, "configs", "run_gpt2_cpu.json")
GPTModel = model_section(GPTConfig)


class GPTRun(RunConfig):
    """A GPT run as scripts/pretrain_gpt.py has it."""

    model: GPTModel = GPTModel()
    sample: SampleSection = SampleSection()


def _parse(*flags: str, run_class: type = GPTRun) -> RunConfig:
    return parse_run(run_class, ["--data-path", "data/p", *flags], RUN_FILE)


def _saved(run: RunConfig) -> str:
    path = os.path.join(os.environ.get("PYTEST_TMP", "/tmp"), f"run_config_{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump(run.to_dict(), f)
    return path


def test_megatron_flags_set_their_fields_and_engine_keys_and_the_printed_config_says_so():
    run = _parse("--num-layers", "3", "--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
                 "--global-batch-size", "16", "--lr", "3e-4", "--weight-decay", "0.05", "--adam-beta1", "0.8",
                 "--adam-beta2", "0.9", "--clip-grad", "0.5", "--bf16", "--use-distributed-optimizer",
                 "--train_iters", "7", "--recompute-activations")
    assert run.model.num_layers == 3 and run.parallel.tensor_model_parallel_size == 2
    assert run.model.recompute_granularity == "selective" and run.schedule.train_iters == 7
    engine = run.engine
    assert (engine["train_micro_batch_size_per_gpu"], engine["train_batch_size"]) == (2, 16)
    assert engine["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.9], "eps": 1e-8, "weight_decay": 0.05}
    assert engine["gradient_clipping"] == 0.5 and engine["bf16"] == {"enabled": True}
    assert engine["zero_optimization"]["stage"] == 1
    # DeepSpeed's WarmupCosineLR ends at --train-iters
    assert engine["scheduler"]["params"]["total_num_steps"] == 7
    printed = describe(run)
    assert "optimizer.params.lr = 0.0003 from --lr (the engine JSON's: 0.001)" in printed
    assert "gradient_clipping = 0.5 from --clip-grad (the engine JSON's: 1.0)" in printed
    # the flags keep what was given (the saved tree says so); a key a flag leaves as it was is not noted
    assert run.training.lr == 3e-4 and run.training.bf16 and run.to_dict()["training"]["clip_grad"] == 0.5
    assert "train_micro_batch_size_per_gpu" in printed and "weight_decay = 0.05" in printed
    same = _parse("--micro-batch-size", "4", "--global-batch-size", "8")  # the engine JSON's own values
    assert not same.engine_notes
    rerun = parse_run(GPTRun, ["--config", _saved(run)], RUN_FILE)  # given again: nothing changes
    assert rerun.engine == run.engine and not rerun.engine_notes


def test_optimizer_muon_makes_the_adam_block_its_adamw_part():
    run = _parse("--optimizer", "muon", "--lr", "0.02", "--adam-beta2", "0.98", "--adam-eps", "1e-9",
                 "--muon-momentum", "0.9", "--muon-nesterov", "False", "--muon-scale-mode", "spectral",
                 "--muon-extra-scale-factor", "0.2", "--muon-num-ns-steps", "6")
    optimizer = run.engine["optimizer"]
    assert optimizer["type"] == "Muon"
    # the recipe JSON's AdamW block becomes Muon's AdamW part; --lr is Muon's own
    assert optimizer["params"] == {"lr": 0.02, "adamw_lr": 0.001, "adamw_weight_decay": 0.1,
                                   "adamw_betas": [0.9, 0.98], "adamw_eps": 1e-9, "momentum": 0.9, "nesterov": False,
                                   "scale_mode": "spectral", "extra_scale_factor": 0.2, "ns_steps": 6}
    assert run.engine_config().optimizer.type == "Muon"  # and the engine accepts it
    assert any("optimizer.type = \"Muon\" from --optimizer" in note for note in run.engine_notes)
    assert _parse("--optimizer", "adam").engine["optimizer"]["type"] == "AdamW"
    with pytest.raises(SystemExit, match="--muon-scale-mode sets a Muon option.*add --optimizer muon"):
        _parse("--muon-scale-mode", "spectral")


def test_one_setting_in_two_spellings_is_an_error_naming_both(capsys):
    with pytest.raises(SystemExit, match="--train-minutes and --exit-duration-in-mins set one setting"):
        _parse("--train-minutes", "1", "--exit-duration-in-mins", "2")
    with pytest.raises(SystemExit, match="--recompute-activations and --recompute-granularity"):
        _parse("--recompute-activations", "--recompute-granularity", "full")
    with pytest.raises(SystemExit, match="--bf16 and --no-bf16"):
        _parse("--bf16", "--no-bf16")
    with pytest.raises(SystemExit, match="--train-iters and --train_iters set one setting"):
        _parse("--train-iters", "3", "--train_iters", "4")
    assert _parse("--train-iters", "3", "--train-iters", "4").schedule.train_iters == 4  # one spelling: the last
    assert _parse("--train-minutes", "1.5").schedule.exit_duration_in_mins == 1.5  # the alias alone


def test_a_flag_megazero_cannot_honour_is_an_error_that_says_why():
    with pytest.raises(SystemExit, match="--attention-backend flash: not honoured here: .*give auto"):
        _parse("--attention-backend", "flash")
    with pytest.raises(SystemExit) as raised:  # a section's own check: its message, no pydantic decoration
        _parse("--bf16", "--fp16")
    assert str(raised.value) == "[megazero] --bf16 and --fp16 are both set: choose one"
    with pytest.raises(SystemExit, match="--untie-embeddings-and-output-weights: not honoured here"):
        _parse("--untie-embeddings-and-output-weights")
    with pytest.raises(SystemExit):  # a flag no tree has: tyro's usage error
        _parse("--no-such-flag", "1")


def test_megatron_lr_flags_make_megatrons_schedule_in_samples():
    run = _parse("--lr", "6e-4", "--min-lr", "6e-5", "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.25",
                 "--lr-decay-iters", "8", "--global-batch-size", "8", "--train-iters", "10")
    assert run.engine["scheduler"] == {"type": "MegatronLR", "params": {
        "decay_style": "cosine", "min_lr": 6e-5, "warmup_init_lr": 0.0, "warmup_num_samples": 16,
        "decay_num_samples": 64, "samples_per_step": 8}}
    assert "scheduler = MegatronLR from the --lr-* flags (the engine JSON's: WarmupCosineLR)" in describe(run)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=6e-4)
    schedule = MegatronLR(optimizer, **run.engine["scheduler"]["params"])
    lrs = [schedule.get_lr()[0]]
    for _ in range(10):
        schedule.step()
        lrs.append(schedule.get_lr()[0])
    # Megatron's formula by hand: warm-up over 2 steps from 0, cosine over steps 2..8, then min_lr
    expected = [6e-4 * n / 2 for n in (0, 1, 2)] + [
        6e-5 + 0.5 * (1 + math.cos(math.pi * (n - 2) / 6)) * (6e-4 - 6e-5) for n in range(3, 9)] + [6e-5, 6e-5]
    assert lrs == pytest.approx(expected, rel=1e-12)
    state = schedule.state_dict()
    again = MegatronLR(optimizer, **run.engine["scheduler"]["params"])
    again.load_state_dict(state)
    assert again.get_lr() == schedule.get_lr()


def test_batch_rampup_grows_as_megatron_says():
    ramp = BatchRampup(start=2, increment=2, samples=24, global_batch_size=8, micro_times_dp=2)
    consumed, sizes = 0, []
    for _ in range(10):
        sizes.append(ramp.batch_size(consumed))
        consumed += sizes[-1]
    # (8 - 2) / 2 = 3 increments over 24 samples: one every 8 samples; 8 from 24 on
    assert sizes == [2, 2, 2, 2, 4, 4, 6, 6, 8, 8]
    with pytest.raises(ValueError, match="not a multiple of micro-batch x data-parallel size 4"):
        BatchRampup(2, 2, 24, 8, micro_times_dp=4)


class Added(RunSection):
    """A section a fork adds."""

    warmup_note: str = "hello"  # what a fork wants to record


class ForkedRun(GPTRun):
    """A fork's run with one setting added: nothing else edited."""

    added: Added = Added()


def test_a_setting_added_to_the_tree_reaches_help_the_printed_and_the_saved_config(tmp_path):
    run = _parse("--warmup-note", "from the flag", run_class=ForkedRun)
    assert run.added.warmup_note == "from the flag"
    assert '"warmup_note": "from the flag"' in describe(run)
    saved = tmp_path / "run_config.json"
    saved.write_text(json.dumps(run.to_dict()))
    again = parse_run(ForkedRun, ["--config", str(saved)], RUN_FILE)
    assert again.added.warmup_note == "from the flag" and again.to_dict() == run.to_dict()
    helped = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.'); "
                             "from tests.unit.test_run_config import ForkedRun, RUN_FILE; "
                             "from megazero.config.cli import parse_run; parse_run(ForkedRun, ['--help'], RUN_FILE)"],
                            capture_output=True, text=True, cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    assert "--warmup-note" in helped.stdout and "what a fork wants to record" in helped.stdout, helped.stdout


def test_every_recipe_flag_shows_in_help_with_its_default():
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "pretrain_gpt.py"), "--help"],
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"}).stdout
    for flag in ("--tensor-model-parallel-size", "--micro-batch-size", "--rampup-batch-size", "--lr-decay-style",
                 "--num-layers", "--deepspeed-config", "--data-path", "--save", "--tensorboard-dir", "--sample-tokens"):
        assert flag in out, flag
    assert "(default: 500)" in out  # --train-iters
    for alias in ("--train-minutes", "--recompute-activations", "--megazero_config"):
        assert alias in out, alias  # the Megatron spellings are listed too


def test_the_parallel_section_is_checked_against_the_world_size():
    run = _parse("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                 "--expert-model-parallel-size", "2")
    assert run.parallel.data_parallel_size(8) == 2
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        run.parallel.data_parallel_size(6)
    with pytest.raises(ValueError, match="--expert-model-parallel-size 2 does not divide the data-parallel size 1"):
        run.parallel.data_parallel_size(4)
    # EP splits DP x CP: two ranks at CP 2 hold one sample shard and two expert groups
    both = _parse("--context-parallel-size", "2", "--expert-model-parallel-size", "2")
    assert both.parallel.data_parallel_size(2) == 1


@pytest.mark.parametrize("flag,value", [("--lr", "inf"), ("--clip-grad", "nan"), ("--min-lr", "-inf")])
def test_a_non_finite_flag_value_is_refused_naming_it(flag, value, capsys):
    with pytest.raises(SystemExit):
        _parse(flag, value)
    err = capsys.readouterr().err
    assert flag[2:].replace("-", "_") in err and ("finite" in err or f"got {float(value)}" in err), err


def test_megatrons_document_flags_give_the_samples_packing():
    from megazero.data.packing import DocumentPacking

    run = _parse("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss")
    assert run.data.document_packing(eod=3) == DocumentPacking(3, True, True, True)
    assert not _parse().data.document_packing(eod=3).enabled


def test_a_warm_up_longer_than_the_run_warns():
    """--train-iters shorter than the engine JSON's warm-up: the run would never leave it."""
    import warnings

    from megazero.config.run import _follow_schedule

    engine = {"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 25, "total_num_steps": 500}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _follow_schedule(engine, 10, None)
        _follow_schedule({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5}}}, 10, None)
    assert [str(w.message)[:68] for w in caught] == [
        "scheduler.params.warmup_num_steps 25 (the engine JSON's) >= --train-"]
    assert engine["scheduler"]["params"]["total_num_steps"] == 10
