"""The op builder: cache keys follow the sources, a broken op falls back with one warning (or
raises under MEGAZERO_OPS_STRICT=1), CUDA ops are skipped with a reason on a CPU build of torch,
`python -m megazero.ops build` fails under strict mode when an op is skipped as incompatible, and
`python -m megazero.ops report` says where each op stands."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megazero.ops import builder
from tests.conftest import REPO, repo_pythonpath


@pytest.fixture()
def broken_op(tmp_path, monkeypatch):
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++;\n")
    monkeypatch.setitem(builder.SPECS, "broken", builder.OpSpec("broken", [str(source)]))
    monkeypatch.setenv("MEGAZERO_OPS_CACHE", str(tmp_path / "cache"))
    builder._failed.pop("broken", None)
    yield source
    builder._failed.pop("broken", None)


def test_cache_key_changes_with_the_sources(broken_op):
    spec = builder.SPECS["broken"]
    before = builder.build_key(spec)
    broken_op.write_text(broken_op.read_text() + "// edited\n")
    assert builder.build_key(spec) != before
    assert builder.build_dir(spec).endswith(builder.build_key(spec))


def test_two_clones_sharing_a_cache_get_their_own_build_directories(tmp_path, monkeypatch):
    """ninja's build file names the source directory, so a second clone (same sources, another
    path) must not reuse, and rebuild over, the first clone's directory."""
    spec = builder.SPECS["cpu_optimizers"]
    here = builder.build_key(spec)
    clone = tmp_path / "csrc"
    clone.mkdir()
    for source in spec.sources:
        (clone / source).write_bytes(open(os.path.join(builder.CSRC, source), "rb").read())
    monkeypatch.setattr(builder, "CSRC", str(clone))
    builder._keys.clear()
    assert builder.build_key(spec) != here
    builder._keys.clear()


def test_failed_build_falls_back_with_a_warning(broken_op, monkeypatch):
    monkeypatch.delenv("MEGAZERO_OPS_STRICT", raising=False)
    with pytest.warns(UserWarning, match="megazero op 'broken' unavailable.*pure-torch reference"):
        assert builder.load_op("broken") is None
    assert builder.load_op("broken") is None  # remembered: no second build, no second warning
    report = builder.status("broken")
    assert report["fallback"] and not report["loaded"] and report["why"]


def test_strict_mode_raises(broken_op, monkeypatch):
    monkeypatch.setenv("MEGAZERO_OPS_STRICT", "1")
    with pytest.raises(RuntimeError, match="could not be built"):
        builder.load_op("broken")


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU build of torch")
def test_cuda_ops_are_incompatible_on_cpu_torch():
    assert "CPU build" in builder.SPECS["cuda_kernels"].incompatible()


def test_report_command():
    out = subprocess.run([sys.executable, "-m", "megazero.ops", "report"], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": repo_pythonpath()}, check=True).stdout
    assert "cpu_optimizers" in out and "cuda_kernels" in out and "compatible" in out


def _build_command(strict: str) -> subprocess.CompletedProcess:
    # no compiler on PATH makes every op incompatible here, so nothing is compiled either way
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "CXX": "megazero-no-such-compiler",
           "MEGAZERO_OPS_STRICT": strict}
    return subprocess.run([sys.executable, "-m", "megazero.ops", "build"], capture_output=True, text=True, cwd=REPO,
                          env=env)


def test_build_command_fails_under_strict_when_an_op_is_incompatible():
    run = _build_command("1")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "cpu_optimizers: FAILED: incompatible here and MEGAZERO_OPS_STRICT=1 (no C++ compiler" in run.stdout
    assert f"{len(builder.SPECS)} op(s) not built" in run.stderr


def test_build_command_skips_incompatible_ops_when_not_strict():
    run = _build_command("0")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "cpu_optimizers: skipped (no C++ compiler" in run.stdout


def test_a_killed_builds_torch_lock_does_not_hang_the_next_build(broken_op, tmp_path):
    """A build killed mid-way leaves torch's `lock` file in the build directory; the next build must
    not wait on it for ever (here it reaches the compiler and fails, as a broken op does)."""
    script = ("from megazero.ops import builder\n"
              f"builder.SPECS['broken'] = builder.OpSpec('broken', [{str(broken_op)!r}])\n"
              "import os; d = builder.build_dir(builder.SPECS['broken']); os.makedirs(d, exist_ok=True)\n"
              "open(os.path.join(d, 'lock'), 'w').close()\n"
              "print('loaded', builder.load_op('broken'))\n")
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "MEGAZERO_OPS_CACHE": str(tmp_path / "cache"),
           "MEGAZERO_OPS_STRICT": "0"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=env, timeout=240)
    assert run.returncode == 0 and "loaded None" in run.stdout, run.stdout + run.stderr
    assert "unavailable" in run.stderr


def test_ranks_loading_an_unbuilt_op_together_build_it_once_and_say_so_once(tmp_path):
    """Two processes load an op that is not built yet, as two ranks do at start-up: one builds it
    (the other waits on the lock and loads its result), and only the builder says it is building."""
    source = tmp_path / "tiny.cpp"
    source.write_text("#include <pybind11/pybind11.h>\n"
                      "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"one\", [] { return 1; }); }\n")
    script = ("import sys\nfrom megazero.ops import builder\n"
              f"builder.SPECS['tiny'] = builder.OpSpec('tiny', [{str(source)!r}])\n"
              "print('one', builder.load_op('tiny').one())\n")
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "MEGAZERO_OPS_CACHE": str(tmp_path / "cache"),
           "MEGAZERO_OPS_STRICT": "1"}
    runs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=REPO, env=env) for _ in range(2)]
    outs = [run.communicate(timeout=240) for run in runs]
    assert all(run.returncode == 0 and "one 1" in out for run, (out, _) in zip(runs, outs)), outs
    assert sum(err.count("[megazero] building op tiny") for _, err in outs) == 1, outs
