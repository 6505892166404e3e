"""Each model keys its dropout masks per layer: the GPT, Llama and BERT recipes at PP=2 (plain and
interleaved) log the losses of the same recipe in one process, with dropout 0.1 (DP=1 in both, so
every micro-batch holds the same samples; a layer's masks are the same whichever stage runs it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.recipes.test_pretrain_bert import bert_prefix  # noqa: F401 (a fixture)
from tests.recipes.test_pretrain_gpt import _scalars

pytestmark = pytest.mark.slow

SHAPE = ("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--dropout", "0.1", "--global-batch-size", "8", "--micro-batch-size", "4", "--lr", "0.003",
         "--train-iters", "5", "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1",
         "--save-interval", "100", "--peak-flops", "1e11")
RECIPE_FLAGS = {"gpt": ("--sample-tokens", "0"), "llama": ("--num-query-groups", "2", "--ffn-hidden-size", "128",
                                                            "--sample-tokens", "0"),
                "bert": ()}
LAYOUTS = {"pp2": ("--pipeline-model-parallel-size", "2"),
           "pp2_interleaved": ("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1")}


def _losses(recipe: str, data_path: str, tmp_path, name: str, nproc: int, layout: tuple[str, ...]) -> list[float]:
    """The recipe's `lm loss` of iterations 1-5 from its TensorBoard events."""
    tb = tmp_path / f"tb_{name}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(REPO, "scripts", f"pretrain_{recipe}.py"), "--data-path", data_path, *SHAPE,
           *RECIPE_FLAGS[recipe], "--save", str(tmp_path / f"ckpt_{name}"), "--tensorboard-dir", str(tb), *layout]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    scalars = _scalars(str(tb))["lm loss"]
    assert [step for step, _ in scalars] == [1, 2, 3, 4, 5]
    return [loss for _, loss in scalars]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """recipe -> (its losses in one process, the same without dropout), each run once per module."""
    made: dict[str, tuple[list[float], list[float]]] = {}

    def get(recipe: str, data_path: str) -> tuple[list[float], list[float]]:
        if recipe not in made:
            tmp = tmp_path_factory.mktemp(f"one_{recipe}")
            made[recipe] = (_losses(recipe, data_path, tmp, "one", 1, ()),
                            _losses(recipe, data_path, tmp, "no_dropout", 1, ("--dropout", "0")))
        return made[recipe]
    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("recipe", list(RECIPE_FLAGS))
def test_pipeline_stages_draw_the_single_process_dropout(recipe, layout, corpus_prefix, one_process, request,
                                                          tmp_path):
    data_path = request.getfixturevalue("bert_prefix") if recipe == "bert" else corpus_prefix
    one, no_dropout = one_process(recipe, data_path)
    # the control: the masks matter, so equal losses are not equal by accident
    assert max(abs(a - b) for a, b in zip(one, no_dropout)) > 1e-3
    staged = _losses(recipe, data_path, tmp_path, layout, 2, LAYOUTS[layout])
    assert staged == pytest.approx(one, abs=1e-4), f"{recipe} at {layout}: {staged} vs one process {one}"
