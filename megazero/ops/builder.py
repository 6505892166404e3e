"""JIT builds of megazero's C++/CUDA ops with torch.utils.cpp_extension (ninja), cached and locked.

Each op is an `OpSpec` (sources, flags, CPU or CUDA). `load_op(name)` builds it on first use,
never at import: into `~/.cache/megazero/ops/<name>-<key>/` (or `$MEGAZERO_OPS_CACHE`), where the
key hashes the torch version and install path, CUDA version, compiler, target ISA/arch, flags, the
source directory and the sources' contents, so a stale build can never be loaded. A file lock
makes concurrent ranks build once and the others wait and load the result. A failed build becomes
one warning and `None` (callers use their pure-torch reference), or an error with
MEGAZERO_OPS_STRICT=1 (so is an op incompatible with this machine, e.g. a CUDA op on a CPU build of
torch). `status()` says, per op, whether it is compatible, built, loaded or falling back, and why.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import subprocess
import sys
import warnings
from dataclasses import dataclass, field

import torch

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


@dataclass
class OpSpec:
    """What to compile for one op."""

    name: str
    sources: list[str]
    cuda: bool = False
    # no FMA contraction: the kernels round each operation as torch's separate ops do. The C++
    # standard is the one the torch built against passes (C++17 under torch 2.11, C++20 under 2.13
    # and 2.14): the sources build as both (`make test-torch-min` builds them under 2.11)
    cflags: list[str] = field(default_factory=lambda: ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"])
    ldflags: list[str] = field(default_factory=lambda: ["-fopenmp"])
    # no --use_fast_math (tanh.approx, approximate sqrt/div, flush-to-zero) and no FMA contraction:
    # the CUDA optimizers then round as the CPU op does, and the fp32 kernels meet their 1e-5 tolerance
    cuda_cflags: list[str] = field(default_factory=lambda: ["-O3", "--fmad=false"])

    def incompatible(self) -> str | None:
        """Why this op cannot be built here (None when it can)."""
        if self.cuda and torch.version.cuda is None:
            return "torch is a CPU build (torch.version.cuda is None): CUDA ops cannot be compiled"
        if self.cuda and not _which("nvcc"):
            return "nvcc not found"
        if not _which(os.environ.get("CXX", "c++")):
            return "no C++ compiler (c++ / $CXX) found"
        return None


SPECS = {
    "cpu_optimizers": OpSpec("cpu_optimizers", ["cpu_optimizers.cpp"]),
    "cpu_norms": OpSpec("cpu_norms", ["cpu_norms.cpp"]),  # fused RMSNorm on CPU
    "cpu_compression": OpSpec("cpu_compression", ["cpu_compression.cpp"]),  # the 1-bit optimizers' compression
    "cuda_kernels": OpSpec("cuda_kernels", ["cuda_kernels.cpp", "cuda_kernels.cu"], cuda=True),
    # plain POSIX I/O on std::threads: no OpenMP, no system library (no libaio or io_uring)
    "aio": OpSpec("aio", ["aio.cpp"], cflags=["-O2", "-pthread"], ldflags=["-pthread"]),
}

_loaded: dict[str, object] = {}
_failed: dict[str, str] = {}


def _which(program: str) -> bool:
    return any(os.access(os.path.join(d, program), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep))


def _compiler_version() -> str:
    try:
        return subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True,
                              timeout=30).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


def _target() -> str:
    """CPU model flags (the ISA the build may assume) or the CUDA arch list."""
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if torch.cuda.is_available() and not arch:
        arch = ",".join(f"{a}.{b}" for a, b in {torch.cuda.get_device_capability(i)
                                                 for i in range(torch.cuda.device_count())})
    return f"{platform.machine()} cuda-arch={arch}"


_keys: dict[tuple, str] = {}  # computed once per process: building may change the environment it hashes


def build_key(spec: OpSpec) -> str:
    """Hash of everything that makes a build reusable."""
    sources = tuple(os.path.getmtime(os.path.join(CSRC, s)) for s in spec.sources
                    + [n for n in sorted(os.listdir(CSRC)) if n.endswith(".h")])
    memo = (spec.name, tuple(spec.sources), sources)
    if memo not in _keys:
        _keys[memo] = _compute_key(spec)
    return _keys[memo]


def _compute_key(spec: OpSpec) -> str:
    h = hashlib.sha256()
    # the source directory and torch's install path too: ninja's build file names both, so two
    # clones or venvs sharing one cache would otherwise rebuild over each other's build directory
    for part in (torch.__version__, str(torch.version.cuda), _compiler_version(), _target(),
                 " ".join(spec.cflags + spec.ldflags + spec.cuda_cflags), CSRC, os.path.dirname(torch.__file__)):
        h.update(part.encode())
    # the sources and the headers beside them (which they include: op_headers.h)
    headers = sorted(name for name in os.listdir(CSRC) if name.endswith(".h"))
    for source in [*spec.sources, *headers]:
        with open(os.path.join(CSRC, source), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def cache_root() -> str:
    """Where builds are kept: $MEGAZERO_OPS_CACHE or ~/.cache/megazero/ops."""
    return os.environ.get("MEGAZERO_OPS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "megazero", "ops"))


def build_dir(spec: OpSpec) -> str:
    """This spec's build directory under the cache (one per key)."""
    return os.path.join(cache_root(), f"{spec.name}-{build_key(spec)}")


def strict() -> bool:
    """MEGAZERO_OPS_STRICT=1: an op that cannot be built here (broken or incompatible) is an error."""
    return os.environ.get("MEGAZERO_OPS_STRICT", "0") == "1"


def load_op(name: str, verbose: bool = False):
    """The compiled module of op `name` (built if needed), or None if it cannot be had here."""
    if name in _loaded:
        return _loaded[name]
    if name in _failed:
        return None
    spec = SPECS[name]
    reason = spec.incompatible()
    try:
        if reason is not None:
            raise RuntimeError(reason)
        module = _build(spec, verbose)
    except Exception as e:  # a compiler error, a missing tool: the reference path takes over
        _failed[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        if strict():
            raise RuntimeError(f"megazero op {name!r} could not be built (MEGAZERO_OPS_STRICT=1): {e}") from e
        warnings.warn(f"megazero op {name!r} unavailable ({_failed[name]}); using the pure-torch reference",
                      stacklevel=2)
        return None
    _loaded[name] = module
    return module


def _build(spec: OpSpec, verbose: bool):
    from torch.utils.cpp_extension import load

    directory = build_dir(spec)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first rank builds; the others wait, then load its result
        try:
            if not any(f.endswith(".so") for f in os.listdir(directory)):  # (under the lock: said once)
                print(f"[megazero] building op {spec.name} (once, cached in {directory})", file=sys.stderr,
                      flush=True)
            _remove_stale_torch_lock(directory)
            return load(name=f"megazero_{spec.name}_{build_key(spec)}",
                        sources=[os.path.join(CSRC, s) for s in spec.sources], extra_cflags=spec.cflags,
                        extra_ldflags=spec.ldflags, extra_cuda_cflags=spec.cuda_cflags if spec.cuda else None,
                        build_directory=directory, verbose=verbose)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_stale_torch_lock(directory: str) -> None:
    """torch's own lock file (`lock`, its FileBaton) outlives a build that was killed, and every later
    load would then wait on it for ever. Only megazero builds here, under the flock held by the
    caller, so a `lock` left now belongs to no live build."""
    stale = os.path.join(directory, "lock")
    if os.path.exists(stale):
        os.remove(stale)


def status(name: str) -> dict:
    """{compatible, built, loaded, fallback, why} for op `name` (builds nothing)."""
    spec = SPECS[name]
    reason = spec.incompatible()
    directory = build_dir(spec) if reason is None or not spec.cuda else ""
    built = bool(directory) and any(f.endswith(".so") for f in os.listdir(directory)) \
        if directory and os.path.isdir(directory) else False
    why = reason or _failed.get(name) or ("" if name in _loaded else "not loaded yet (built lazily on first use)")
    return {"compatible": reason is None, "built": built, "loaded": name in _loaded,
            "fallback": name in _failed or reason is not None, "why": why}
