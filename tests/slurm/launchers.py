"""What the launcher tests share: the launchers in scripts/, the README's flags for a tiny model,
where each launcher's log goes by default, and the environment a user would have."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys

from tests.conftest import REPO, wait_for_data_prep

# every file in scripts/ that `sbatch` or `bash` runs (test_every_launcher_is_tested keeps the two
# complete): LAUNCHERS train a recipe (TINY_FLAGS), DATA_LAUNCHERS write datasets
LAUNCHERS = ("pretrain_gpt2.sbatch", "pretrain_gpt2.sh", "pretrain_llama.sbatch", "pretrain_llama.sh",
             "pretrain_bert.sh")
DATA_LAUNCHERS = ("preprocess_data.sbatch",)
# the .sbatch names its log in its header (logs/ is committed); sbatch's default is slurm-<id>.out
# in the directory sbatch was called from
DEFAULT_LOG = {"pretrain_gpt2.sbatch": "logs/megazero-gpt2-{job}.out",
               "pretrain_llama.sbatch": "logs/megazero-llama-{job}.out",
               "pretrain_gpt2.sh": "slurm-{job}.out", "pretrain_llama.sh": "slurm-{job}.out",
               "pretrain_bert.sh": "slurm-{job}.out"}
# an array job's tasks log one file each: {job} is the array job id, {task} the task id
DEFAULT_ARRAY_LOG = {"preprocess_data.sbatch": "logs/megazero-preprocess-{job}_{task}.out"}
# recipe flags from the README's flag list: a 2-layer model, logging every 5 iterations, no
# evaluation or checkpoint before the end
TINY = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--log-interval", "5", "--eval-interval", "1000", "--eval-iters", "2", "--save-interval", "1000")
TINY_FLAGS = {"pretrain_gpt2.sbatch": (*TINY, "--global-batch-size", "8", "--micro-batch-size", "4", "--lr", "0.005"),
              "pretrain_gpt2.sh": (*TINY, "--global-batch-size", "8", "--micro-batch-size", "4", "--lr", "0.005"),
              "pretrain_llama.sh": (*TINY, "--num-query-groups", "2", "--ffn-hidden-size", "128",
                                    "--global-batch-size", "8", "--micro-batch-size", "4", "--lr", "0.005"),
              "pretrain_llama.sbatch": (*TINY, "--num-query-groups", "2", "--ffn-hidden-size", "128",
                                        "--global-batch-size", "8", "--micro-batch-size", "4", "--lr", "0.005"),
              "pretrain_bert.sh": (*TINY, "--global-batch-size", "16", "--micro-batch-size", "8", "--lr", "0.001")}
# the launchers' own knobs: a test sets only those it means to, as the README documents them
LAUNCHER_ENV = ("MEGAZERO_DIR", "PYTHON", "LAUNCHER", "NPROC", "NPROC_PER_NODE", "DATA_PATH", "SAVE_DIR",
                "TB_DIR", "CONFIG", "MODEL_CONFIG", "TRAIN_ITERS", "OMP_NUM_THREADS", "MAX_RESTARTS",
                "INPUT", "OUTPUT_PREFIX", "TOKENIZER", "VOCAB_SIZE", "WORKERS", "WAIT_MINUTES")
BERT_PREFIX = os.path.join(REPO, "data", "bert", "shakespeare")


def user_env(overrides: dict[str, str], outside_slurm: bool = False) -> dict[str, str]:
    """The caller's environment without the launchers' knobs (and, outside Slurm, without SLURM_*),
    plus `overrides`."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_ENV and not (outside_slurm and k.startswith("SLURM_") and k != "SLURM_CONF")}
    return {**env, **overrides}


def ensure_data(launcher: str) -> None:
    """The dataset the launcher's default DATA_PATH names, made by `make data` / `make data-bert`."""
    wait_for_data_prep()
    target, stamp = (("data-bert", BERT_PREFIX + "_train_text_sentence.idx") if "bert" in launcher else
                     ("data", os.path.join(REPO, "data", "gpt2", "shakespeare_train_text_document.idx")))
    if not os.path.exists(stamp):
        subprocess.run(["make", "-C", REPO, target, f"PYTHON={sys.executable}"], check=True)


def losses(log: str) -> list[float]:
    """Training losses of the console lines."""
    return [float(x) for x in re.findall(r"\| lm loss: ([0-9.]+) \| learning rate", log)]


def header_output_paths(launcher: str) -> list[str]:
    """The --output/--error paths of a launcher's #SBATCH header lines."""
    text = open(os.path.join(REPO, "scripts", launcher)).read()
    return re.findall(r"^#SBATCH\s+(?:--output|--error|-o|-e)[=\s]+(\S+)", text, flags=re.MULTILINE)


def run_in_own_session(cmd: list[str], env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """Run cmd in a new session; on timeout kill the whole session (torchrun's workers too), then fail."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        tail = f"{out[-3000:]}\n{err[-3000:]}"
        raise AssertionError(f"{' '.join(cmd)} did not finish within {timeout}s\n{tail}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


WORDS = ("king", "queen", "fool", "ghost", "duke", "maid", "storm", "crown", "sword", "night")
# the data launcher's knobs for the small corpus of small_corpus(): a tokenizer that corpus can train
SMALL_VOCAB = "300"


def small_corpus(directory) -> list[str]:
    """Three small input files in `directory` (two jsonl of 30 documents, one text file): paths."""
    rng = random.Random(0)

    def text(sentences: int) -> str:
        return " ".join(f"The {rng.choice(WORDS)} saw the {rng.choice(WORDS)}{rng.choice('.!?')}"
                        + ("\n" if rng.random() < 0.3 else "") for _ in range(sentences))

    os.makedirs(directory, exist_ok=True)
    paths = []
    for i in range(2):
        paths.append(os.path.join(directory, f"shard{i}.jsonl"))
        with open(paths[-1], "w") as f:
            f.writelines(json.dumps({"text": text(rng.randint(1, 12))}) + "\n" for _ in range(30))
    paths.append(os.path.join(directory, "play.txt"))
    with open(paths[-1], "w") as f:
        f.write(text(150))
    return paths


def dataset_files(prefix: str) -> dict[str, bytes]:
    """The merged dataset family of `prefix` (P_*.bin, .idx, _stats.json; not the P_part* outputs)."""
    directory, base = os.path.split(prefix)
    return {name[len(base):]: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))
            if name.startswith(base + "_") and "_part" not in name and name.endswith((".bin", ".idx", "_stats.json"))}


def one_preprocess_run(inputs: list[str], prefix: str, tokenizer: str) -> dict[str, bytes]:
    """dataset_files of one scripts/preprocess_data.py run over `inputs` (its defaults, `tokenizer`),
    run in this process (no interpreter start-up)."""
    script = os.path.join(REPO, "scripts", "preprocess_data.py")
    spec = importlib.util.spec_from_file_location("_preprocess_data", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--input", *inputs, "--output-prefix", prefix, "--tokenizer-model", tokenizer])
    return dataset_files(prefix)
