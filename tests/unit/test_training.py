"""megazero.training, the helpers the recipes' loops call: the recipes' run configs (defaults from any
directory), the import rule (the library never imports models/ or scripts/, no script imports
another), and the GPT recipe's loop in a real process: a real SIGUSR1 mid-run that saves a
checkpoint and stops, and a time budget that ends the run validated."""

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

from megazero.config import load_config_source
from megazero.config.cli import parse_run
from tests.conftest import REPO, repo_pythonpath

SCRIPTS = os.path.join(REPO, "scripts")


def _load_script(name: str):
    """scripts/<name>.py as a module (the scripts are files, not a package)."""
    spec = importlib.util.spec_from_file_location(f"_script_{name}", os.path.join(SCRIPTS, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # tyro reads the run classes' source through their module
    spec.loader.exec_module(module)
    return module


def test_run_config_defaults_and_tokenizer_default(tmp_path):
    gpt = _load_script("pretrain_gpt")
    run = parse_run(gpt.GPTRun, ["--data-path", "data/p"], gpt.RUN_FILE)
    assert run.data.tokenizer_model == "data/p_tokenizer.model"
    schedule = run.schedule
    assert (schedule.train_iters, schedule.save_interval, schedule.eval_interval, schedule.eval_iters,
            schedule.log_interval, run.seed) == (500, 100, 100, 20, 10, 1234)
    engine = tmp_path / "x.json"
    engine.write_text(json.dumps({"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.5}}}))
    run = parse_run(gpt.GPTRun, ["--data-path", "data/p", "--tokenizer-model", "tok.model", "--deepspeed_config",
                                 str(engine)], gpt.RUN_FILE)
    assert (run.data.tokenizer_model, run.engine["optimizer"]["params"]["lr"]) == ("tok.model", 0.5)
    with pytest.raises(SystemExit):
        parse_run(gpt.GPTRun, ["--data-path", "p", "--bf16", "--fp16"], gpt.RUN_FILE)


@pytest.mark.parametrize("script,model_json,engine_json", [
    ("pretrain_gpt", "gpt2_cpu.json", "ds_gpt2_cpu.json"), ("pretrain_bert", "bert_cpu.json", "ds_bert_cpu.json"),
    ("pretrain_llama", "llama_cpu.json", "ds_gpt2_cpu.json")])
def test_script_default_configs_resolve_from_any_directory(tmp_path, monkeypatch, script, model_json, engine_json):
    monkeypatch.chdir(tmp_path)
    module = _load_script(script)
    run_class = next(v for k, v in vars(module).items() if k.endswith("Run") and isinstance(v, type))
    run = parse_run(run_class, ["--data-path", "p"], module.RUN_FILE)
    assert dataclasses.asdict(run.model).items() >= json.load(open(os.path.join(REPO, "configs", model_json))).items()
    expected = load_config_source(os.path.join(REPO, "configs", engine_json))
    assert run.engine["optimizer"] == expected["optimizer"] and run.engine["zero_optimization"] == \
        expected["zero_optimization"]


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
    import importlib.util, json, os, signal, sys

    import megazero.causal_lm_recipe as recipe
    from megazero.data import GPTDataset

    prefix, config_path, out_path, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])


    class SignalsAt(GPTDataset):
        '''Sends this process SIGUSR1 as the kill_at-th training sample is read.'''
        reads = 0

        def __getitem__(self, i):
            if self.shuffle:
                SignalsAt.reads += 1
                if SignalsAt.reads == kill_at:
                    os.kill(os.getpid(), signal.SIGUSR1)
            return super().__getitem__(i)


    recipe.GPTDataset = SignalsAt
    spec = importlib.util.spec_from_file_location("pretrain_gpt", os.path.join(os.environ["PYTHONPATH"], "scripts",
                                                                               "pretrain_gpt.py"))
    gpt = importlib.util.module_from_spec(spec)
    sys.modules["pretrain_gpt"] = gpt
    spec.loader.exec_module(gpt)
    result = gpt.main(["--data-path", prefix, "--deepspeed_config", config_path, "--num-layers", "1", "--hidden-size",
                       "32", "--num-attention-heads", "2", "--seq-length", "16", "--train-iters", "10",
                       "--eval-interval", "2", "--eval-iters", "2", "--log-interval", "2", "--save",
                       os.path.join(os.path.dirname(out_path), "ckpt"), "--save-interval", "100", "--peak-flops",
                       "1e11", "--sample-tokens", "2", *sys.argv[5:]])
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
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(program), prefix, str(config), str(out), str(kill_at), *flags],
                          capture_output=True, text=True, env=env, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def _validated(stdout: str) -> list[int]:
    return [int(line.split()[3]) for line in stdout.splitlines() if line.startswith(" validation at iteration")]


@pytest.mark.slow
def test_train_validates_and_a_signal_saves_and_stops(corpus_prefix, tmp_path):
    kill_at = 3 * 8 + 1  # the first sample of iteration 4 (8 samples per iteration)
    proc, result = _run_program(corpus_prefix, tmp_path, kill_at)
    assert "1 ranks = TP 1 x PP 1 x DP 1, batch 8 = 4 x 2 x 1, torch.float32, peak 100.0 GFLOP/s" \
        in proc.stdout, proc.stdout
    assert "received SIGUSR1: checkpoint saved at iteration 4, exiting" in proc.stdout, proc.stdout
    assert result["iteration"] == 4 and _validated(proc.stdout) == [2]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step4"
    assert [line.split("|")[0].split() for line in proc.stdout.splitlines() if line.startswith(" iteration")] == [
        ["iteration", "2/10"], ["iteration", "4/10"]]


@pytest.mark.slow
def test_a_run_stopped_by_its_time_budget_ends_validated(corpus_prefix, tmp_path):
    """--train-minutes reached between evaluations: the last validation is of the last iteration
    (what the run reached), and the ETA counts down to the budget, not to --train-iters."""
    budget_s = 1e-6 * 60  # --train-minutes 1e-6: past it after the first iteration
    # 100,000 iterations to go would be minutes of ETA at any speed; the budget leaves none
    proc, result = _run_program(corpus_prefix, tmp_path, -1, "--train-minutes", "1e-6", "--log-interval",
                                "1", "--eval-interval", "4", "--train-iters", "100000")
    assert "time budget of 1e-06 min reached at iteration 1" in proc.stdout, proc.stdout
    assert result["iteration"] == 1 and _validated(proc.stdout) == [1]
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
