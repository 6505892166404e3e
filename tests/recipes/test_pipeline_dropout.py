"""Each model keys its dropout masks per layer: the BERT recipe at PP=2 and the GPT and Llama recipes
at PP=2 under the zero-bubble zbv schedule (two chunks per stage in a V, the first stage holding the
first and the last layers) log the losses of the same recipe in one process, with dropout 0.1 (DP=1
in both, so every micro-batch holds the same samples; a layer's masks are the same whichever stage
and chunk run it). The GPT and Llama recipes share their training loop (megazero/training.py); the
pipelined GPT with dropout, plain and interleaved, is tests/distributed/test_model_parallel.py's,
BERT's interleaved test_bert.py's."""

from __future__ import annotations

import subprocess

import pytest

from tests.launch_helpers import finish, start, torchrun
from tests.recipes.test_pretrain_bert import bert_prefix  # noqa: F401 (a fixture)
from tests.recipes.test_pretrain_gpt import _scalars

pytestmark = pytest.mark.slow

SHAPE = ("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--dropout", "0.1", "--global-batch-size", "8", "--micro-batch-size", "2", "--lr", "0.003",
         "--train-iters", "5", "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1",
         "--save-interval", "100", "--peak-flops", "1e11")
RECIPE_FLAGS = {"llama": ("--num-query-groups", "2", "--ffn-hidden-size", "128", "--sample-tokens", "0"),
                "bert": (), "gpt": ()}
PP2 = ("--pipeline-model-parallel-size", "2")
ZBV = ("--pipeline-schedule", "zbv")  # 4 micro-batches per step: zbv's least at PP=2; the GPT samples at the end
CASES = [("bert", "pp2", PP2), ("llama", "pp2_zbv", (*PP2, *ZBV)), ("gpt", "pp2_zbv", (*PP2, *ZBV))]


def _start(recipe: str, data_path: str, tmp_path, name: str, nproc: int, layout: tuple[str, ...]) -> subprocess.Popen:
    """The recipe under torchrun, started (TensorBoard events in tmp_path/tb_<name>)."""
    return start(torchrun(f"pretrain_{recipe}.py", "--data-path", data_path, *SHAPE, *RECIPE_FLAGS[recipe], "--save",
                          str(tmp_path / f"ckpt_{name}"), "--tensorboard-dir", str(tmp_path / f"tb_{name}"), *layout,
                          nproc=nproc), tmp_path)


def _losses(tmp_path, name: str) -> list[float]:
    """The `lm loss` of iterations 1-5 of a finished _start run."""
    scalars = _scalars(str(tmp_path / f"tb_{name}"))["lm loss"]
    assert [step for step, _ in scalars] == [1, 2, 3, 4, 5]
    return [loss for _, loss in scalars]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """recipe -> (its losses in one process, the same without dropout), each run once per module."""
    made: dict[str, tuple[list[float], list[float]]] = {}

    def get(recipe: str, data_path: str) -> tuple[list[float], list[float]]:
        if recipe not in made:  # one process each: the two run side by side on the two cores
            tmp = tmp_path_factory.mktemp(f"one_{recipe}")
            finish(_start(recipe, data_path, tmp, "one", 1, ()),
                   _start(recipe, data_path, tmp, "no_dropout", 1, ("--dropout", "0")))
            made[recipe] = (_losses(tmp, "one"), _losses(tmp, "no_dropout"))
        return made[recipe]
    return get


@pytest.mark.parametrize("recipe,layout,flags", CASES, ids=[f"{r}-{n}" for r, n, _ in CASES])
def test_pipeline_stages_draw_the_single_process_dropout(recipe, layout, flags, corpus_prefix, one_process, request,
                                                          tmp_path):
    data_path = request.getfixturevalue("bert_prefix") if recipe == "bert" else corpus_prefix
    one, no_dropout = one_process(recipe, data_path)
    # the control: the masks matter, so equal losses are not equal by accident
    assert max(abs(a - b) for a, b in zip(one, no_dropout)) > 1e-3
    output = finish(_start(recipe, data_path, tmp_path, layout, 2, flags))[0]
    if "zbv" in layout:
        assert "pipeline: 2 stages x 2 model chunks in a V, schedule zbv" in output
    if recipe == "gpt":  # generated through both chunks of each stage
        assert "----- sample -----" in output
    staged = _losses(tmp_path, layout)
    assert staged == pytest.approx(one, abs=1e-4), f"{recipe} at {layout}: {staged} vs one process {one}"
