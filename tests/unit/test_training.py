"""megazero.training, the recipe loop as a library: its parser and flag overlays, the scripts'
default config paths from any directory, the import rule (the library never imports models/ or
scripts/, no script imports another), and train() end to end in a real process: validation
hooks, a real SIGUSR1 mid-run that saves a checkpoint and stops, and evaluate() with a measure."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from megazero.training import model_overrides, recipe_parser
from models.bert import BertConfig
from models.gpt import GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "scripts")


def _load_script(name: str):
    """scripts/<name>.py as a module (the scripts are files, not a package)."""
    spec = importlib.util.spec_from_file_location(f"_script_{name}", os.path.join(SCRIPTS, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recipe_parser_defaults_and_tokenizer_default():
    parser = recipe_parser("desc", "model.json", "engine.json")
    args = parser.parse_args(["--data-path", "data/p"])
    assert (args.model_config, args.megazero_config) == ("model.json", "engine.json")
    assert args.tokenizer_model == "data/p_tokenizer.model"
    assert (args.train_iters, args.save_interval, args.eval_interval, args.eval_iters, args.log_interval,
            args.seed) == (500, 100, 100, 20, 10, 1234)
    args = parser.parse_args(["--data-path", "data/p", "--tokenizer-model", "tok.model", "--deepspeed_config", "x"])
    assert (args.tokenizer_model, args.megazero_config) == ("tok.model", "x")
    with pytest.raises(SystemExit):
        parser.parse_args(["--data-path", "p", "--bf16", "--fp16"])


@pytest.mark.parametrize("script,model_json,engine_json", [
    ("pretrain_gpt", "gpt2_cpu.json", "ds_gpt2_cpu.json"), ("pretrain_bert", "bert_cpu.json", "ds_bert_cpu.json"),
    ("lr_range_test", "gpt2_cpu.json", "ds_gpt2_cpu.json")])
def test_script_default_configs_resolve_from_any_directory(tmp_path, monkeypatch, script, model_json, engine_json):
    monkeypatch.chdir(tmp_path)
    args = _load_script(script).parse_args(["--data-path", "p"])
    args = args[1] if isinstance(args, tuple) else args  # lr_range_test: (its own flags, the recipe's)
    assert args.model_config == os.path.join(REPO, "configs", model_json)
    assert args.megazero_config == os.path.join(REPO, "configs", engine_json)
    assert os.path.isfile(args.model_config) and os.path.isfile(args.megazero_config)


def test_model_overrides_name_fields_of_every_model_config():
    args = recipe_parser("", "m", "e").parse_args(["--data-path", "p", "--num-layers", "3", "--sequence-parallel",
                                                   "--recompute-granularity", "selective"])
    overrides = model_overrides(args)
    assert overrides["num_layers"] == 3 and overrides["sequence_parallel"] is True
    assert overrides["recompute_granularity"] == "selective" and overrides["hidden_size"] is None
    assert recipe_parser("", "m", "e").parse_args(["--data-path", "p"]).sequence_parallel is False
    assert model_overrides(recipe_parser("", "m", "e").parse_args(["--data-path", "p"]))["sequence_parallel"] is None
    for config_class in (GPTConfig, BertConfig):
        fields = {f.name for f in dataclasses.fields(config_class)}
        assert set(overrides) <= fields, (config_class.__name__, set(overrides) - fields)


def _imported_modules(path: str) -> set[str]:
    tree = ast.parse(open(path).read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_library_imports_neither_models_nor_scripts_and_no_script_imports_another():
    scripts = {name[:-3] for name in os.listdir(SCRIPTS) if name.endswith(".py")}
    for root, _, files in os.walk(os.path.join(REPO, "megazero")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                bad = _imported_modules(path) & ({"models", "scripts"} | scripts)
                assert not bad, f"{os.path.relpath(path, REPO)} imports {sorted(bad)}"
    for name in scripts:
        bad = _imported_modules(os.path.join(SCRIPTS, name + ".py")) & (scripts - {name})
        assert not bad, f"scripts/{name}.py imports the scripts {sorted(bad)}"


PROGRAM = textwrap.dedent("""
    import json, os, signal, sys

    from megazero import parallel_state, training
    import megazero
    from megazero.data import GPTDataset, IndexedDataset
    from models.gpt import GPTConfig
    from models.parallelize import parallelize
    from tests.training_helpers import TINY

    prefix, config_path, out_path, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    args = training.recipe_parser("", "unused", config_path).parse_args(
        ["--data-path", prefix, "--train-iters", "10", "--eval-interval", "2", "--eval-iters", "2",
         "--log-interval", "2", "--save", os.path.join(os.path.dirname(out_path), "ckpt"), "--save-interval",
         "100", "--peak-flops", "1e11", *sys.argv[5:]])
    megazero.init_distributed()
    grid = parallel_state.initialize_model_parallel(1, 1)
    megazero.set_seed(args.seed)
    model = parallelize(GPTConfig(**TINY), grid)
    args.seq_length = TINY["seq_length"]


    class SignalsAt(GPTDataset):
        '''Sends this process SIGUSR1 as the kill_at-th training sample is read.'''
        reads = 0

        def __getitem__(self, i):
            SignalsAt.reads += 1
            if SignalsAt.reads == kill_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            return super().__getitem__(i)


    train_data = SignalsAt(IndexedDataset(prefix), args.seq_length, seed=args.seed)
    valid_data = GPTDataset(IndexedDataset(prefix), args.seq_length, shuffle=False)
    validated, measured = [], {}

    def validate(engine):
        validated.append(engine.global_steps)
        measured["default"] = training.evaluate(engine, valid_data, 2)
        measured["twice"] = training.evaluate(engine, valid_data, 2, lambda b: {"loss": engine.eval_batch(b),
                                                                               "twice": 2 * engine.eval_batch(b)})
        return measured["default"]["loss"]

    def finish(engine, val_loss, reason):
        return {"iteration": engine.global_steps, "val_loss": val_loss, "reason": reason, "validated": validated,
                **measured}

    result = training.train(args, model, train_data, grid=grid, name="Tiny", num_params=1, flops_per_token=1.0,
                            validate=validate, finish=finish, details=lambda peak: f"peak {peak:g}")
    json.dump(result, open(out_path, "w"))
""")


def _run_program(prefix: str, tmp_path, kill_at: int, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    """PROGRAM in a lone process (world size 1) over a tiny engine config: its output and result."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    program = tmp_path / "run.py"
    program.write_text(PROGRAM)
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(program), prefix, str(config), str(out), str(kill_at), *flags],
                          capture_output=True, text=True, env=env, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_train_validates_and_a_signal_saves_and_stops(token_dataset_prefix, tmp_path):
    kill_at = 3 * 8 + 1  # the first sample of iteration 4 (8 samples per iteration)
    proc, result = _run_program(token_dataset_prefix, tmp_path, kill_at)
    assert "Tiny: 1 parameters, 1 ranks = TP 1 x PP 1 x DP 1, batch 8 = 4 x 2 x 1, torch.float32, peak 1e+11" \
        in proc.stdout, proc.stdout
    assert "received SIGUSR1: checkpoint saved at iteration 4, exiting" in proc.stdout, proc.stdout
    assert (result["iteration"], result["reason"], result["validated"]) == (4, "signal", [2])
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step4"
    assert [line.split("|")[0].split() for line in proc.stdout.splitlines() if line.startswith(" iteration")] == [
        ["iteration", "2/10"], ["iteration", "4/10"]]
    assert result["twice"]["loss"] == result["default"]["loss"] == result["val_loss"]
    assert result["twice"]["twice"] == pytest.approx(2 * result["default"]["loss"], rel=1e-12)


@pytest.mark.slow
def test_a_run_stopped_by_its_time_budget_ends_validated(token_dataset_prefix, tmp_path):
    """--train-minutes reached between evaluations: the last validation is of the last iteration
    (what the run reached), and the ETA counts down to the budget, not to --train-iters."""
    budget_s = 1e-6 * 60  # --train-minutes 1e-6: past it after the first iteration
    # 100,000 iterations to go would be minutes of ETA at any speed; the budget leaves none
    proc, result = _run_program(token_dataset_prefix, tmp_path, -1, "--train-minutes", "1e-6", "--log-interval",
                                "1", "--eval-interval", "4", "--train-iters", "100000")
    assert "time budget of 1e-06 min reached at iteration 1" in proc.stdout, proc.stdout
    assert (result["iteration"], result["reason"], result["validated"]) == (1, "time", [1])
    etas = [float(line.split("ETA:")[1].split()[0]) for line in proc.stdout.splitlines() if "ETA:" in line]
    assert etas and all(eta <= budget_s / 60 for eta in etas), proc.stdout


@pytest.mark.slow
def test_a_bad_engine_config_stops_the_recipe_with_one_line_naming_file_and_key(corpus_prefix, tmp_path):
    """A DeepSpeed user's typo reaches them as one line (file, key path, value), not a traceback."""
    config = json.load(open(os.path.join(REPO, "configs", "ds_gpt2_cpu.json")))
    config["optimizer"]["params"]["betas"] = [0.9]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "pretrain_gpt.py"), "--data-path",
                           corpus_prefix, "--deepspeed_config", str(bad), "--num-layers", "1", "--hidden-size", "32",
                           "--num-attention-heads", "2", "--seq-length", "16", "--train-iters", "1"],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert str(bad) in last and "'optimizer.params.betas'" in last and "[0.9]" in last, last
