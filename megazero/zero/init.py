"""Build a model already partitioned (`zero.Init`) and gather parameters for user code
(`zero.GatheredParameters`), for ZeRO stage 3.

Under `Init`, a module's parameters are partitioned over the data-parallel ranks when the
`__init__` of its parent returns: so code in a parent's `__init__` may still initialise its
children's weights, while no rank ever holds more than one module's subtree whole. Each rank
keeps only its chunk of each parameter; the stage-3 engine later regroups the chunks unit by unit.
Code that changes parameters after that must do it inside `GatheredParameters(params, modifier_rank=r)`.

Where the partitions live (`partition_device`): `Init(device=...)` if given; else, under NCCL, the
GPU this rank trains on (`megazero.distributed.training_device`: local rank modulo the visible
GPUs), so a model built on the CPU is partitioned straight onto its GPU; else (gloo) where each
parameter was built. The emptied parameters sit on that device too, so the model reports the
device it will train on. Moving the model afterwards (`model.cuda()`, `.to(dtype)`) moves only the
empty parameters; each chunk follows its parameter when the stage-3 engine makes it whole again.

`Init(remote_device="nvme", config_dict_or_path=...)` (or a config whose
`zero_optimization.offload_param.device` is nvme) writes each chunk to a swap file under the
config's `offload_param.nvme_path` instead of keeping it (megazero.zero.swap): no rank holds more
than the subtree being built. The engine reads each chunk back as it builds that unit, and with
parameter offload on moves the unit's partitions to its own swap files before the next unit
(megazero.zero.param_offload); Init's files go once every chunk has been read.
"""

from __future__ import annotations

import functools
import json

import torch
import torch.distributed as dist

from megazero.accelerator import get_accelerator, training_device
from megazero.model_contract import is_expert_parameter
from megazero.zero.collectives import all_gather_chunks
from megazero.zero.model_broadcast import broadcast_from_first_rank


def _all_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out.add(sub)
        out |= _all_subclasses(sub)
    return out


def partition_device(backend: str, device: torch.device | str | None = None, local_rank: int | None = None,
                     device_count: int | None = None) -> torch.device | None:
    """Where zero.Init keeps a rank's chunks: `device` if given; under NCCL the rank's training GPU
    (cuda:(local_rank % device_count); defaults: the launcher's local rank, the visible GPUs);
    otherwise None: each chunk stays on the device its parameter was built on."""
    if device is not None:
        return torch.device(device)
    if backend != "nccl":
        return None
    if device_count is None:
        accelerator = get_accelerator()
        device_count = accelerator.device_count() if accelerator.device_name() == "cuda" else 0
    if device_count == 0:
        raise RuntimeError("zero.Init: the data-parallel group is NCCL but this process sees no GPU; pass "
                           "Init(device=...)")
    return training_device(local_rank, device_count)


class _InitSwap:
    """Swap files holding Init's chunks (remote_device nvme) until the engine reads them back; the
    directory is removed once nothing refers to this object (every chunk read) or at exit."""

    def __init__(self, nvme_path: str, group, aio: dict):
        from megazero.zero.swap import run_swap_files

        self.files = run_swap_files(nvme_path, group, aio)
        self.count = 0

    def write(self, chunk: torch.Tensor) -> str:
        """Write `chunk` to a new file; returns its name."""
        name = f"init{self.count:07d}"
        self.count += 1
        self.files.wait(self.files.submit_write(name, chunk))
        return name

    def read(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The chunk written as `name`."""
        chunk = torch.empty(numel, dtype=dtype)
        self.files.wait(self.files.submit_read(name, chunk))
        return chunk


def _remote_config(remote_device: str | None, config) -> tuple[str | None, str | None, dict]:
    """(remote device, nvme_path, aio settings) from Init's arguments and a DeepSpeed config (dict or
    JSON file path)."""
    if isinstance(config, str):
        with open(config) as f:
            config = json.load(f)
    config = config or {}
    offload = (config.get("zero_optimization") or {}).get("offload_param") or {}
    device = remote_device or offload.get("device")
    if device in (None, "none", "cpu"):
        return None, None, {}
    if device != "nvme":
        raise ValueError(f"zero.Init: remote_device must be 'cpu', 'nvme' or None, got {device!r}")
    path = offload.get("nvme_path")
    if not path:
        raise ValueError("zero.Init(remote_device='nvme') needs 'zero_optimization.offload_param.nvme_path' in "
                         "config_dict_or_path (a directory for the swap files)")
    return device, path, dict(config.get("aio") or {})


def _shard_param(p: torch.nn.Parameter, group, device: torch.device | None = None,
                 swap: _InitSwap | None = None, expert_group=None) -> None:
    """Keep this rank's chunk of `p` (padded to a multiple of the world size) on `device` (None:
    p's own), or in a swap file (`swap`); p becomes an empty tensor there. An expert parameter is
    partitioned over `expert_group` (the ranks that hold the same experts), the rest over `group`."""
    if hasattr(p, "_megazero_init_chunk") or hasattr(p, "_megazero_init_swap"):
        return
    if is_expert_parameter(p):
        group = expert_group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    # every rank keeps its slice of the same parameter: the group's first rank's
    broadcast_from_first_rank([p.data], group if group is not None else dist.group.WORLD)
    device = p.device if device is None else device
    chunk = -(-p.numel() // world)
    # only this rank's slice is copied: no padded copy of the whole parameter, even for a moment
    mine = p.detach().reshape(-1)[rank * chunk:(rank + 1) * chunk]
    kept = torch.zeros(chunk, dtype=p.dtype, device=device)
    kept[:mine.numel()] = mine
    if swap is not None:
        p._megazero_init_swap = (swap, swap.write(kept), chunk, p.dtype)
    else:
        p._megazero_init_chunk = kept
    p._megazero_init_shape = p.shape
    p._megazero_init_group = group
    p.data = torch.empty(0, dtype=p.dtype, device=device)


def materialize_init_shard(p: torch.nn.Parameter) -> None:
    """Make a parameter partitioned by Init whole again (all-gather its chunks over the group Init
    cut them for) on the device and in the dtype the (empty) parameter has now: Init's, or wherever
    the model was moved since."""
    chunk = getattr(p, "_megazero_init_chunk", None)
    swapped = getattr(p, "_megazero_init_swap", None)
    if swapped is not None:
        swap, name, numel, dtype = swapped
        chunk = swap.read(name, numel, dtype)
        del p._megazero_init_swap
    if chunk is None:
        return
    shape, group = p._megazero_init_shape, p._megazero_init_group
    device = p.device
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        raise RuntimeError(f"zero.Init: a parameter of shape {tuple(shape)} is on {device}, but its NCCL group "
                           f"gathers only CUDA tensors: build under Init(device=<the GPU>) or move the model "
                           f"to the GPU before initialize()")
    world = dist.get_world_size(group)
    flat = torch.empty(chunk.numel() * world, dtype=chunk.dtype, device=device)
    flat.view(world, -1)[dist.get_rank(group)].copy_(chunk)
    all_gather_chunks(flat, group).wait()
    p.data = flat[:shape.numel()].view(shape).to(p.dtype)
    if hasattr(p, "_megazero_init_chunk"):
        del p._megazero_init_chunk
    del p._megazero_init_shape, p._megazero_init_group


class Init:
    """Context manager: modules built inside are partitioned over `data_parallel_group` as they are
    built, each rank's chunks on `device` (default: see partition_device; `self.device` once entered),
    or with `remote_device` 'nvme' (or `config_dict_or_path` saying offload_param nvme) in swap files
    under the config's offload_param.nvme_path. Expert (MoE) parameters are partitioned over
    `expert_data_parallel_group` (default: megazero.parallel_state's, once a grid is initialised;
    else `data_parallel_group`), the group the engine's expert state partitions them over."""

    def __init__(self, data_parallel_group=None, enabled: bool = True, device: torch.device | str | None = None,
                 remote_device: str | None = None, config_dict_or_path=None, expert_data_parallel_group=None):
        self.group = data_parallel_group
        self.expert_group = expert_data_parallel_group
        self.remote_device, self._nvme_path, self._aio = _remote_config(remote_device, config_dict_or_path)
        self.swap: _InitSwap | None = None
        self.enabled = enabled
        self.requested_device = device
        self.device: torch.device | None = None
        self._patched: list[tuple[type, object]] = []
        self._built: list[torch.nn.Module] = []

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        if not dist.is_initialized():
            raise RuntimeError("zero.Init needs torch.distributed initialised (megazero.init_distributed())")
        self.device = partition_device(dist.get_backend(self.group), self.requested_device)
        if self.expert_group is None:
            from megazero import parallel_state

            self.expert_group = (parallel_state.get_expert_data_parallel_group()
                                 if parallel_state.model_parallel_is_initialized() else self.group)
        if self.remote_device == "nvme":
            self.swap = _InitSwap(self._nvme_path, self.group, self._aio)
        for cls in _all_subclasses(torch.nn.Module):
            if "__init__" in cls.__dict__:
                original = cls.__dict__["__init__"]
                self._patched.append((cls, original))
                cls.__init__ = self._wrap(original)
        return self

    def _wrap(self, original):
        @functools.wraps(original)
        def init(module, *args, **kwargs):
            depth = getattr(module, "_megazero_init_depth", 0)
            object.__setattr__(module, "_megazero_init_depth", depth + 1)
            try:
                original(module, *args, **kwargs)
            finally:
                object.__setattr__(module, "_megazero_init_depth", depth)
            if depth == 0:  # the most-derived __init__ is done: partition the children's subtrees
                for child in module.children():
                    for p in child.parameters():
                        _shard_param(p, self.group, self.device, self.swap, self.expert_group)
                self._built.append(module)
        return init

    def __exit__(self, *exc) -> None:
        for cls, original in reversed(self._patched):
            cls.__init__ = original
        self._patched.clear()
        if exc[0] is None:
            for module in self._built:  # the outermost modules' own parameters
                for p in module.parameters():
                    _shard_param(p, self.group, self.device, self.swap, self.expert_group)
        self._built.clear()
        self.swap = None  # the parameters keep it (their files) until the engine has read every chunk


class GatheredParameters:
    """Context manager: the ZeRO-3 units holding `params` are whole inside it. With `modifier_rank`,
    changes made on that data-parallel rank are broadcast and kept (also in the fp32 masters) on exit.
    Parameters not partitioned by ZeRO-3 are left alone."""

    def __init__(self, params, modifier_rank: int | None = None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._units: list = []

    def __enter__(self):
        if not self.enabled:
            return self
        seen = set()
        for p in self.params:
            unit = getattr(p, "_megazero_unit", None)
            if unit is not None and id(unit) not in seen:
                seen.add(id(unit))
                self._units.append((unit, unit.gathered))
                unit.gather()
        return self

    def __exit__(self, *exc) -> None:
        for unit, was_gathered in self._units:
            if self.modifier_rank is not None and exc[0] is None:
                for shard in unit.shards:
                    shard.take_modification(self.modifier_rank)
            if not was_gathered:
                unit.release()
        self._units.clear()
