"""DeepSpeed's CIFAR-10 tutorial, as its users write it (tests/tutorials/cifar10_deepspeed_style.py:
the tutorial's flags, config dict and loop; `import megazero as deepspeed` and the accelerator import
are the edits), trains on 2 gloo ranks with a falling loss: every ZeRO stage, every precision (ZeRO-2 in bf16 is
what DeepSpeed itself runs here); the other pairs are the engine's tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, repo_pythonpath

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(REPO, "tests", "tutorials", "cifar10_deepspeed_style.py")


def _train(stage: int, dtype: str, tmp_path) -> list[float]:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           SCRIPT, "--stage", str(stage), "--dtype", dtype, "--samples", "1024"],
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo_pythonpath()})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Finished Training" in proc.stdout
    line = next(line for line in proc.stdout.splitlines() if line.startswith("LOSSES "))
    return json.loads(line[len("LOSSES "):])


@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (1, "fp16"), (2, "bf16"), (3, "fp16")])
def test_cifar10_tutorial_trains(stage, dtype, tmp_path):
    losses = _train(stage, dtype, tmp_path)
    assert len(losses) == 1024 // 16  # one epoch of 16-image global batches, 8 per rank
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < first - 0.3, (stage, dtype, first, last)
