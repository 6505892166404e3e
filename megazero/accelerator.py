"""The device a rank trains on, behind DeepSpeed's accelerator interface: `get_accelerator()`.

    from megazero.accelerator import get_accelerator     # DeepSpeed: from deepspeed.accelerator import ...
    device = get_accelerator().device_name(local_rank)    # "cuda:1" on a GPU host, "cpu" without one

One object answers for the whole process, and megazero itself asks it: init_distributed sets the
GPU and picks the backend through it, the recipes move their model to `current_device_name()`.
CUDA when torch sees a GPU, the CPU otherwise; DeepSpeed's DS_ACCELERATOR=cpu|cuda forces one.

The subset of DeepSpeed's interface that training scripts call: device_name, current_device_name,
current_device, device, set_device, device_count, is_available, synchronize, manual_seed,
manual_seed_all, communication_backend_name, is_bf16_supported, is_fp16_supported, pin_memory,
on_accelerator, empty_cache, memory_allocated, max_memory_allocated, reset_peak_memory_stats.
Left out: streams and events, graphs, RNG-state getters and setters beyond manual_seed, op builders
(megazero builds its ops with megazero.ops), and the other vendors' accelerators.
"""

from __future__ import annotations

import os
import resource

import torch

from megazero.launch_env import detect_launch_env

ACCELERATOR_ENV = "DS_ACCELERATOR"  # DeepSpeed's name, so a job's environment means the same here


def select_device_index(local_rank: int, device_count: int) -> int:
    """The GPU (an index among the visible ones) a rank uses: local_rank % device_count.

    Under `srun --gpus-per-task=1` or `--gpu-bind`, each rank sees only its own GPU(s), as index 0
    up, while its local rank counts the node's tasks; with more ranks than visible GPUs, ranks
    share them in turn. Either way the local rank alone is not a valid device ordinal."""
    if device_count < 1:
        raise ValueError(f"select_device_index: no visible GPU (device_count {device_count}) for local rank "
                         f"{local_rank}")
    if local_rank < 0:
        raise ValueError(f"select_device_index: local rank must be >= 0, got {local_rank}")
    return local_rank % device_count


class CPUAccelerator:
    """The CPU: one device, gloo, bf16 and fp16 (megazero's CPU ops and torch's), no cache to empty."""

    _name = "cpu"

    def device_name(self, device_index: int | None = None) -> str:
        """"cpu" (the CPU has no device index)."""
        return "cpu"

    def current_device_name(self) -> str:
        """"cpu"."""
        return "cpu"

    def current_device(self) -> int:
        """0: the one CPU device."""
        return 0

    def device(self, device_index: int | None = None) -> torch.device:
        """torch.device("cpu")."""
        return torch.device("cpu")

    def set_device(self, device_index: int) -> None:
        """Nothing to select on the CPU."""

    def device_count(self) -> int:
        """1: the CPU, shared by this node's ranks."""
        return 1

    def is_available(self) -> bool:
        """True: there is always a CPU."""
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        """CPU work is done when its call returns."""

    def manual_seed(self, seed: int) -> None:
        """Seed torch's CPU generator."""
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed torch's CPU generator (there is one device)."""
        torch.manual_seed(seed)

    def communication_backend_name(self) -> str:
        """gloo."""
        return "gloo"

    def is_bf16_supported(self) -> bool:
        """True: torch's CPU kernels and megazero's CPU optimizers take bfloat16."""
        return True

    def is_fp16_supported(self) -> bool:
        """True: float16 compute with a loss scale runs on the CPU (slowly where the CPU lacks fp16 units)."""
        return True

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """The tensor itself: pinning is for copies to a GPU."""
        return tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives on this accelerator's device type."""
        return tensor.device.type == "cpu"

    def empty_cache(self) -> None:
        """No allocator cache to release on the CPU."""

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes of this process's resident memory (what the CPU's allocations occupy)."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """The most resident memory this process has held since its start or the last
        reset_peak_memory_stats, in bytes (Linux's VmHWM; at least memory_allocated())."""
        peak = None
        try:
            with open("/proc/self/status") as f:
                peak = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), None)
        except OSError:
            pass
        if peak is None:  # not Linux: the process's lifetime peak
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(peak, self.memory_allocated())

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Start max_memory_allocated again from the current resident memory (Linux: the kernel's
        peak is reset through /proc/self/clear_refs; elsewhere the lifetime peak stays)."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


class CUDAAccelerator(CPUAccelerator):
    """NVIDIA GPUs through torch.cuda: NCCL, "cuda:N" devices."""

    _name = "cuda"

    def device_name(self, device_index: int | None = None) -> str:
        """"cuda", or "cuda:N" for an index."""
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device_name(self) -> str:
        """"cuda:N" of the current GPU."""
        return f"cuda:{torch.cuda.current_device()}"

    def current_device(self) -> int:
        """The current GPU's index."""
        return torch.cuda.current_device()

    def device(self, device_index: int | None = None) -> torch.device:
        """torch.device("cuda", N) (the current GPU without an index)."""
        return torch.device("cuda", torch.cuda.current_device() if device_index is None else device_index)

    def set_device(self, device_index: int) -> None:
        """Make GPU `device_index` the current one."""
        torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        """The GPUs this process sees."""
        return torch.cuda.device_count()

    def is_available(self) -> bool:
        """Whether torch sees a GPU."""
        return torch.cuda.is_available()

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for the GPU's queued work."""
        torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        """Seed the current GPU's generator."""
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed every GPU's generator."""
        torch.cuda.manual_seed_all(seed)

    def communication_backend_name(self) -> str:
        """nccl."""
        return "nccl"

    def is_bf16_supported(self) -> bool:
        """Whether the GPU computes in bfloat16 (Ampere and later)."""
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        """True: every CUDA GPU torch supports computes in float16."""
        return True

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """A page-locked copy, for fast copies to the GPU."""
        return tensor.pin_memory()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is on a GPU."""
        return tensor.is_cuda

    def empty_cache(self) -> None:
        """Release the caching allocator's unused blocks."""
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes of tensors allocated on the GPU."""
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """The peak of memory_allocated since the start (or the last reset)."""
        return torch.cuda.max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Start max_memory_allocated again from now."""
        torch.cuda.reset_peak_memory_stats(device_index)


_accelerator: CPUAccelerator | None = None


def _choose() -> CPUAccelerator:
    wanted = os.environ.get(ACCELERATOR_ENV, "").strip().lower()
    if wanted not in ("", "cpu", "cuda"):
        raise ValueError(f"{ACCELERATOR_ENV}={wanted!r}: megazero has the 'cpu' and 'cuda' accelerators")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{ACCELERATOR_ENV}=cuda, but torch sees no GPU (torch.cuda.is_available() is False)")
    if wanted == "cpu" or not torch.cuda.is_available():
        return CPUAccelerator()
    return CUDAAccelerator()


def get_accelerator() -> CPUAccelerator:
    """This process's accelerator (chosen once: CUDA when torch sees a GPU, else the CPU;
    $DS_ACCELERATOR forces one)."""
    global _accelerator
    if _accelerator is None:
        _accelerator = _choose()
    return _accelerator


def set_accelerator(accelerator: CPUAccelerator) -> None:
    """Use `accelerator` from now on (DeepSpeed's set_accelerator)."""
    global _accelerator
    _accelerator = accelerator


def training_device(local_rank: int | None = None, device_count: int | None = None) -> torch.device:
    """Where this rank trains: cuda:(local_rank % device_count) on the CUDA accelerator, else the CPU.
    local_rank defaults to the launcher's, device_count to the GPUs this process sees."""
    accelerator = get_accelerator()
    if device_count is None:
        device_count = accelerator.device_count() if accelerator.device_name() == "cuda" else 0
    if device_count == 0:
        return torch.device("cpu")
    if local_rank is None:
        local_rank = detect_launch_env().local_rank
    return torch.device("cuda", select_device_index(local_rank, device_count))
