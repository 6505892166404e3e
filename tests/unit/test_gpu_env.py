"""The GPU machine's environment has one source of truth (scripts/gpu_env.py): the image's package
list (ci/gpu_image.txt) and the carried wheels (ci/gpu_wheels.txt) cover every runtime dependency in
pyproject.toml and everything those need; a dependency added without either is caught."""

from __future__ import annotations

import importlib.util
import os

from packaging.requirements import Requirement

from tests.conftest import REPO


def _gpu_env():
    spec = importlib.util.spec_from_file_location("gpu_env", os.path.join(REPO, "scripts", "gpu_env.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_runtime_dependency_is_on_the_image_or_carried():
    gpu_env = _gpu_env()
    assert gpu_env.uncovered() == []
    assert gpu_env.wheel_pins() == gpu_env.wheels_needed(), "ci/gpu_wheels.txt is stale: python scripts/gpu_env.py lock"
    assert "torch" in gpu_env.image_packages() and "pydantic" in gpu_env.wheel_pins()


def test_a_dependency_in_neither_list_is_named():
    gpu_env = _gpu_env()
    with_new = gpu_env.runtime_dependencies() + [Requirement("leftpad>=1.0")]
    assert gpu_env.uncovered(with_new) == ["leftpad"]
    pins = gpu_env.wheel_pins()
    del pins["typeguard"]  # tyro needs it, the image lacks it
    assert gpu_env.uncovered(pins=pins) == [f"typeguard=={gpu_env.closure([Requirement('tyro')], set())['typeguard']}"]
    assert gpu_env.uncovered(image=gpu_env.image_packages() - {"numpy"}) == ["numpy"]
