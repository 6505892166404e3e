"""Per-rank memory of model states: an estimate from the ZeRO formulas of this implementation, and
a measurement of the tensors an engine actually holds.

Bytes per parameter (Psi parameters, N data-parallel ranks, p = 2 for bf16/fp16 models, 4 for fp32;
k = 8 for Adam's two fp32 moments; m = 4 for the fp32 master copy of a 16-bit model, 0 for an fp32
model, whose own (partitioned) parameters are the masters):

| stage | parameters | gradients | optimizer (moments + masters) |
|---|---|---|---|
| 0 | p Psi | 4 Psi (fp32 buffer) | (k + m) Psi |
| 1 | p Psi | 4 Psi (fp32 buffer; each rank's reduced chunk stays in it) | (k + m) Psi/N |
| 2 | p Psi | 4 Psi/N (+ staging buckets while reducing) | (k + m) Psi/N |
| 3 | p Psi/N (+ the gathered layer while in use) | 4 Psi/N (+ staging) | (k + m) Psi/N |

With offload_optimizer nvme the optimizer column and (stages 2-3) the gradient column go to disk,
with offload_param nvme (stage 3) the parameter column: memory keeps bounded buffers (below).

For comparison, the ZeRO paper (mixed-precision Adam, fp16 gradients): 16 Psi, 4 Psi + 12 Psi/N,
2 Psi + 14 Psi/N, 16 Psi/N. Gradients are kept in fp32 here (exact accumulation over micro-steps).
Partitioned sizes include the padding of each bucket to a multiple of N.
"""

from __future__ import annotations

import os
import weakref

import torch

SWAP_HEADER_BYTES = 4096  # megazero.zero.swap.HEADER_BYTES (not imported: profiling stays light)
GRAD_ALIGN_ELEMENTS = 1024  # megazero.zero.grad_swap.ALIGN_ELEMENTS: each gradient chunk's region in its file
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "lamb": 8, "sgd": 4, "sgd_no_momentum": 0}


def estimate_zero_memory(model_or_num_params, num_ranks: int, stage: int, precision: str = "bf16",
                         optimizer: str = "adam", offload_optimizer: str = "none",
                         sub_group_size: int = 1_000_000_000, buffer_count: int = 4,
                         reduce_bucket_size: int = 500_000_000, offload_param: str = "none",
                         max_in_cpu: int = 0, persistent_params: int = 0,
                         param_swap_files: int = 0) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and optimizer states for this implementation, in
    memory ("total") and on disk ("disk"; of which "param_disk" parameters).

    offload_optimizer "nvme" (stages 1-3): the masters (16-bit models) and the optimizer states go
    to the swap files, (k + m) Psi/N bytes of disk; memory keeps min(buffer_count, sub-groups)
    sub-group buffers of (k + m) bytes per sub-group element (a sub-group: as many whole master
    chunks, reduce_bucket_size/N elements each, as fit in sub_group_size; one when a chunk is
    larger; at most this rank's whole partition). At stages 2 and 3 the reduced fp32 gradient
    partition goes to the swap files too (4 Psi/N bytes of disk, each master chunk's region padded
    to 4 KiB): memory keeps backward's ring of min(buffer_count, chunks) chunks and the step's
    read buffers, min(buffer_count, sub-groups) of 4 bytes per sub-group element (neither the
    files nor the read buffers when the partition fits in the ring; stage 1's reduced chunks are
    views of its full gradient buffer and stay). "cpu" on a
    CPU-only machine is the in-memory path (host memory on a GPU: the same bytes, on the host).

    offload_param "nvme" (stage 3): the partitions of the partitioned parameters go to swap files,
    p (Psi - persistent_params)/N bytes of disk plus a 4 KiB header per file (param_swap_files:
    one per unit and param group, if known); memory keeps the persistent_params whole (those under
    stage3_param_persistence_threshold; their partitions, 1/N more, too) and at most max_in_cpu
    cached partition elements between uses (during a step, up to two units' partitions more while
    they are gathered). Every shard then has its own fp32 master (m = 4 for an fp32 model too),
    which offload_optimizer "nvme" puts on disk with the optimizer states."""
    if isinstance(model_or_num_params, torch.nn.Module):
        psi = sum(p.numel() for p in model_or_num_params.parameters() if p.requires_grad)
    else:
        psi = int(model_or_num_params)
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0-3, got {stage}")
    if offload_param not in ("none", "cpu", "nvme"):
        raise ValueError(f"offload_param must be none, cpu or nvme, got {offload_param!r}")
    swapped_params = offload_param == "nvme"
    if swapped_params and stage != 3:
        raise ValueError(f"parameter offload needs ZeRO stage 3, got stage {stage}")
    p = 4 if precision == "fp32" else 2
    # a separate fp32 master for 16-bit models, and for every model whose partitions are swapped
    per_param = OPTIMIZER_STATE_BYTES[optimizer.lower()] + (4 if p == 2 or swapped_params else 0)
    n = num_ranks
    params = p * psi / (n if stage == 3 else 1)
    param_disk = 0.0
    if swapped_params:
        partitioned = (psi - persistent_params) / n
        # a persistent parameter: whole on every rank, and its partition kept for the optimizer
        params = p * (persistent_params * (1 + 1 / n) + min(max_in_cpu, partitioned))
        param_disk = p * partitioned + SWAP_HEADER_BYTES * param_swap_files
    grads = 4 * psi / (n if stage >= 2 else 1)
    optim = per_param * psi / (n if stage >= 1 else 1)
    disk = 0.0
    if offload_optimizer == "nvme":
        if stage == 0:
            raise ValueError("optimizer offload needs ZeRO stage 1, 2 or 3")
        disk = optim
        partition = psi / n
        chunk = min(reduce_bucket_size / n, partition)
        group = min(max(chunk, (sub_group_size // chunk) * chunk), partition)
        buffers = min(buffer_count, max(1, -(-int(partition) // int(group))))
        optim = buffers * per_param * group
        if stage >= 2:  # read buffers of the step, backward's ring; on disk what does not fit in the ring
            chunks = max(1, -(-int(partition) // int(chunk)))
            grads = min(buffer_count, chunks) * 4 * chunk
            if buffer_count < chunks:  # (else the partition stays in the ring: no file, no read buffer)
                disk += 4 * (partition + chunks * GRAD_ALIGN_ELEMENTS / 2)  # (half a block of padding per chunk)
                grads += buffers * 4 * group + 4 * chunk  # (and a chunk to accumulate evicted ones in)
    elif offload_optimizer not in ("none", "cpu"):
        raise ValueError(f"offload_optimizer must be none, cpu or nvme, got {offload_optimizer!r}")
    return {"parameters": params, "gradients": grads, "optimizer_states": optim, "total": params + grads + optim,
            "disk": disk + param_disk, "param_disk": param_disk, "num_params": psi}


def paper_zero_memory(num_params: int, num_ranks: int, stage: int) -> float:
    """The ZeRO paper's per-rank bytes for mixed-precision Adam (K = 12)."""
    psi, n = num_params, num_ranks
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def current_rss_bytes() -> int:
    """This process's resident set size now (Linux /proc), 0 where unavailable."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class ActivationMeter:
    """Counts the bytes a forward keeps for backward: every tensor autograd saves (parameters
    excluded) and every input an activation checkpoint keeps for its recompute, each storage once.

        with ActivationMeter() as meter:
            loss = model(batch)
        meter.bytes
    """

    _active: list[ActivationMeter] = []

    def __init__(self):
        self.bytes = 0
        self._seen: set[int] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack_saved)

    def add(self, t: torch.Tensor) -> None:
        """Count `t`'s storage unless already counted (or a parameter's)."""
        if isinstance(t, torch.nn.Parameter) or t.numel() == 0 or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()

    def _pack(self, t: torch.Tensor):
        self.add(t)
        return _pack_saved(t)

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        ActivationMeter._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        ActivationMeter._active.remove(self)
        self._hooks.__exit__(*exc)
        self._seen = set()


class _Saved:
    """A tensor autograd saved while a PeakActivationMeter runs: counted until autograd drops it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _pack_saved(t: torch.Tensor):
    if not PeakActivationMeter._active:
        return t
    saved = _Saved(t)
    hold_for_backward([t], saved)
    return saved


def _unpack_saved(packed):
    return packed.tensor if isinstance(packed, _Saved) else packed


class PeakActivationMeter:
    """The most bytes kept for backward at any one time while it runs: the tensors autograd saves in
    the engine's forwards (parameters and the `exclude` tensors' storages left out), each storage
    once while anything keeps it, and what hold_for_backward registers (a split backward's pending
    weight-gradient inputs). A pipeline schedule's activation peak per rank:

        with PeakActivationMeter(exclude=model.parameters()) as meter:
            engine.train_batch(data)
        meter.peak
    """

    _active: list[PeakActivationMeter] = []

    def __init__(self, exclude=()):
        self.live = self.peak = 0
        self._holders: dict[int, list[int]] = {}  # storage pointer -> [holders, bytes]
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}

    def hold(self, t: torch.Tensor, owner: object) -> None:
        """Count `t`'s storage while `owner` lives."""
        if isinstance(t, torch.nn.Parameter) or t.numel() == 0 or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        pointer = storage.data_ptr()
        if pointer in self._excluded:
            return
        entry = self._holders.setdefault(pointer, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(owner, self._release, pointer)

    def _release(self, pointer: int) -> None:
        entry = self._holders[pointer]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._holders[pointer]

    def __enter__(self) -> PeakActivationMeter:
        PeakActivationMeter._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        PeakActivationMeter._active.remove(self)


def hold_for_backward(tensors, owner: object) -> None:
    """Tell the running PeakActivationMeters that `tensors` are kept for backward while `owner` lives."""
    for meter in PeakActivationMeter._active:
        for t in tensors:
            if t is not None:
                meter.hold(t, owner)


def record_activation(t: torch.Tensor) -> None:
    """Tell the active meter (if any) that `t` is kept for backward outside autograd's saved tensors."""
    for meter in ActivationMeter._active:
        meter.add(t)


def engine_memory_report(engine) -> dict[str, int]:
    """Bytes this rank holds now in parameters, gradients and optimizer states, the activations the
    last forward kept for backward, plus RSS (and CUDA allocator figures on GPUs)."""
    held = engine.dp.memory_tensors()
    optimizer = list(held["optimizer"])
    for state in engine.optimizer.state.values():
        optimizer += [v for v in state.values() if torch.is_tensor(v)]
    report = {"parameters": tensor_bytes(held["parameters"]), "gradients": tensor_bytes(held["gradients"]),
              "optimizer_states": tensor_bytes(optimizer), "rss": current_rss_bytes()}
    report["total"] = report["parameters"] + report["gradients"] + report["optimizer_states"]
    report["activations"] = engine.last_activation_bytes
    if torch.cuda.is_available():
        report["cuda_allocated"] = torch.cuda.memory_allocated()
        report["cuda_peak"] = torch.cuda.max_memory_allocated()
    return report
