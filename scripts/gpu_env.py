"""What a lent GPU machine needs carried to run megazero: the one source of truth.

The GPU machine's image (ci/gpu_image.txt: its package list, with the date it was read) has torch
and most of megazero's dependencies but reaches no package index. What it lacks travels as wheels
for its Python (3.12) in .whl/, listed with pinned versions in ci/gpu_wheels.txt:

    megazero's runtime dependencies (pyproject.toml [project] dependencies) and everything they need,
    less what the image has, less NOT_CARRIED, plus FOR_VERSION.

  python scripts/gpu_env.py missing    the runtime dependencies the image lacks
  python scripts/gpu_env.py lock       recompute ci/gpu_wheels.txt from this environment's installed
                                       versions (`make install` pins them: requirements.txt)
  python scripts/gpu_env.py download   fetch exactly ci/gpu_wheels.txt's wheels into .whl/ (`make gpu-wheels`)

tests/unit/test_gpu_env.py fails when a runtime dependency is in neither list.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE_LIST = os.path.join(REPO, "ci", "gpu_image.txt")
WHEEL_LIST = os.path.join(REPO, "ci", "gpu_wheels.txt")
IMAGE_PYTHON = "3.12"
# pip matches manylinux tags exactly: the ones the image's glibc runs
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
# runtime dependencies left behind on purpose: nothing a GPU check runs imports them
NOT_CARRIED = {"wandb": "imported only when the engine config enables wandb (megazero/monitor.py)"}
# on the image, but carried for the version megazero's pins need (the image's is not known)
FOR_VERSION = {"typing-extensions": "pydantic-core 2.50 needs >= 4.16"}


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_dependencies(pyproject: str = os.path.join(REPO, "pyproject.toml")) -> list[Requirement]:
    """pyproject.toml's [project] dependencies."""
    with open(pyproject, "rb") as f:
        return [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]


def image_packages(path: str = IMAGE_LIST) -> set[str]:
    """The distribution names the image has (canonical)."""
    with open(path) as f:
        return {canonical(line.strip()) for line in f if line.strip() and not line.startswith("#")}


def wheel_pins(path: str = WHEEL_LIST) -> dict[str, str]:
    """{canonical name: version} of the wheels carried."""
    pins = {}
    with open(path) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                name, version = line.split("==")
                pins[canonical(name)] = version
    return pins


def _image_environment(extra: str = "") -> dict[str, str]:
    env = default_environment()
    env.update(python_version=IMAGE_PYTHON, python_full_version=f"{IMAGE_PYTHON}.3", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", implementation_name="cpython", extra=extra)
    return env


def closure(requirements: list[Requirement], image: set[str]) -> dict[str, str]:
    """{canonical name: installed version} of `requirements` and what they need on the image's Python
    (this environment's installed metadata: its versions are the pinned ones), not descending into
    packages the image has. KeyError names a package this environment lacks."""
    found: dict[str, str] = {}
    todo = [r for r in requirements if r.marker is None or r.marker.evaluate(_image_environment())]
    while todo:
        req = todo.pop()
        name = canonical(req.name)
        if name in found or (name in image and name not in FOR_VERSION):
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise KeyError(f"{req.name} (needed on the GPU machine) is not installed here: `make install`") from None
        found[name] = dist.version
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or sub.marker.evaluate(_image_environment()):
                todo.append(sub)
    return found


def missing_on_image(requirements: list[Requirement] | None = None, image: set[str] | None = None) -> list[str]:
    """The runtime dependencies the image lacks (carried or NOT_CARRIED)."""
    image = image_packages() if image is None else image
    return sorted(canonical(r.name) for r in (requirements or runtime_dependencies()) if canonical(r.name) not in image)


def wheels_needed(requirements: list[Requirement] | None = None, image: set[str] | None = None) -> dict[str, str]:
    """{name: version} to carry: the closure of the runtime dependencies the image lacks (NOT_CARRIED
    left out), with FOR_VERSION."""
    image = image_packages() if image is None else image
    requirements = requirements or runtime_dependencies()
    wanted = [r for r in requirements if canonical(r.name) not in NOT_CARRIED]
    return dict(sorted(closure(wanted, image).items()))


def uncovered(requirements: list[Requirement] | None = None, image: set[str] | None = None,
              pins: dict[str, str] | None = None) -> list[str]:
    """What the GPU machine would lack: each runtime dependency neither on the image, nor carried,
    nor NOT_CARRIED, and each package a carried one needs that is neither on the image nor carried
    (at its pinned version)."""
    image = image_packages() if image is None else image
    pins = wheel_pins() if pins is None else pins
    requirements = requirements or runtime_dependencies()
    lacking = [canonical(r.name) for r in requirements
               if canonical(r.name) not in image | set(pins) | set(NOT_CARRIED)]
    carried = [r for r in requirements if canonical(r.name) in pins]
    needed = closure(carried, image)
    lacking += [f"{name}=={version}" for name, version in needed.items() if pins.get(name) != version]
    return sorted(lacking)


def write_lock(path: str = WHEEL_LIST) -> dict[str, str]:
    """Write ci/gpu_wheels.txt from wheels_needed()."""
    pins = wheels_needed()
    with open(path, "w") as f:
        f.write(f"# Wheels carried to the GPU machine for its Python {IMAGE_PYTHON}: megazero's runtime\n"
                "# dependencies and what they need, less the image's packages (ci/gpu_image.txt). Written by\n"
                "# `python scripts/gpu_env.py lock`; `make gpu-wheels` downloads exactly these into .whl/.\n")
        for name, reason in NOT_CARRIED.items():
            f.write(f"# not carried: {name}, {reason}\n")
        for name, reason in FOR_VERSION.items():
            f.write(f"# carried although the image has it: {name}, {reason}\n")
        f.writelines(f"{name}=={version}\n" for name, version in pins.items())
    return pins


def download(dest: str, python: str = sys.executable) -> None:
    """pip download each pinned wheel for the image's Python and platforms (no dependencies: the list
    is the closure)."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
                    IMAGE_PYTHON, "--implementation", "cp", *platforms, "-d", dest,
                    *(f"{n}=={v}" for n, v in wheel_pins().items())], check=True)


def main(argv=None) -> int:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["missing", "lock", "download"])
    p.add_argument("--dest", default=os.path.join(REPO, ".whl"), help="download: where the wheels go")
    args = p.parse_args(argv)
    if args.command == "missing":
        print("\n".join(missing_on_image()))
    elif args.command == "lock":
        pins = write_lock()
        print(f"wrote {WHEEL_LIST}: {', '.join(f'{n}=={v}' for n, v in pins.items())}")
    else:
        download(args.dest)
        print(f"wheels in {args.dest}: carry it to the GPU machine (`make check-gpu` installs them there)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
