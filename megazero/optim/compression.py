"""1-bit compressed averaging over a data-parallel group, with error feedback (1-bit Adam's scheme).

The tensors to average (the optimizers' preconditioned momenta or gradients) live in one flat fp32
buffer (`BlockLayout`):
each tensor starts on a block boundary, and each block of `BLOCK` elements is sent as one bit per
element (its sign; zero counts as positive) and one fp32 scale, the root mean square of the
block's real elements, so that sign x scale keeps the block's L2 norm. What the rounding loses is
kept (the error) and added to the next round's input, so nothing is lost over time, only delayed.

One `CompressedAllReduce.average` is the two-phase scheme of Tang et al. (2021), "1-bit Adam":
1. each rank (a worker) compresses its buffer plus its worker error and sends block chunk r to
   rank r (all-to-all);
2. rank r (the server of chunk r) decodes what the W workers sent, averages it, adds its server
   error, compresses that again and every rank gathers every server's chunk (all-gather);
3. every rank decodes the same result: the compressed average.
A rank sends 2 x (W-1)/W x (N/8 bytes + 4 bytes per block) for N elements, against 2 x (W-1)/W x
4N for an fp32 all-reduce: about 1/31 at BLOCK 2048. The collectives are megazero.zero.collectives'
(point-to-point and broadcasts on gloo, the native ones on NCCL).

Padding (between tensors and at the end), and any positions the caller excludes
(`CompressedAllReduce.exclude`), never carries a value: it is zeroed in the input, the errors and
the result of every round, and counts in no block's scale.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.zero.collectives import all_gather_chunks, exchange_chunks

BLOCK = 2048  # elements per scale: a multiple of 8 (whole bytes of signs)

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


class BlockLayout:
    """Where each of a list of tensors (by element count) sits in one flat buffer: every tensor
    starts on a multiple of `block` and the total is a multiple of `world` x `block`, so the buffer
    splits into `world` equal chunks of whole blocks (one per server)."""

    def __init__(self, numels: list[int], world: int, block: int = BLOCK):
        if block % 8:
            raise ValueError(f"block {block} is not a multiple of 8")
        self.block, self.world = block, world
        self.numels = list(numels)
        self.offsets = []
        end = 0
        for n in self.numels:
            self.offsets.append(end)
            end += -(-n // block) * block
        span = world * block
        self.numel = max(span, -(-end // span) * span)
        self.blocks = self.numel // block
        real = torch.zeros(self.numel, dtype=torch.bool)
        for offset, n in zip(self.offsets, self.numels):
            real[offset:offset + n] = True
        # real elements per block (a block of padding only counts 1: its scale is 0 either way)
        self.counts = real.view(self.blocks, block).sum(dim=1).clamp(min=1).float()
        self.padding = (~real).nonzero().flatten()

    def views(self, flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
        """Each tensor's view of `flat` (a buffer of this layout), in the given shapes."""
        return [flat[o:o + n].view(shape) for o, n, shape in zip(self.offsets, self.numels, shapes)]

def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """One bit per element (1: >= 0), 8 to a byte, first element in the high bit."""
    positive = (values >= 0).view(-1, 8).to(torch.uint8)
    return positive.mul_(_BIT_WEIGHTS.to(values.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_signs: a bool per element (True: positive)."""
    return (bits.unsqueeze(-1) >> _SHIFTS.to(bits.device)).bitwise_and_(1).view(*bits.shape[:-1], -1).bool()


def decode(bits: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """sign x scale per element: `bits` from pack_signs, one scale per `block` elements."""
    positive = unpack_signs(bits.reshape(-1)).view(-1, block)
    scale = scales.reshape(-1, 1)
    return torch.where(positive, scale, -scale).view(-1)


def compression_op():
    """The compiled CPU op (megazero/ops/csrc/cpu_compression.cpp), or None: the torch code runs."""
    from megazero.ops.builder import load_op

    return load_op("cpu_compression")


def compress(values: torch.Tensor, error: torch.Tensor, counts: torch.Tensor, padding: torch.Tensor,
             block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(signs, scales) of values + error, one scale per `block` elements: the root mean square over
    their `counts` real elements (squares summed in fp64); `error` becomes what the signs and scales
    leave out, zero on `padding`. CPU tensors run the C++ op where it builds (the same arithmetic)."""
    op = compression_op() if values.device.type == "cpu" else None
    if op is not None:
        bits = torch.empty(values.numel() // 8, dtype=torch.uint8)
        scales = torch.empty(values.numel() // block, dtype=torch.float32)
        op.compress_(values, error, counts, bits, scales, block)
    else:
        error.add_(values)
        squares = error.view(-1, block).double().square().sum(dim=1)
        scales = squares.div_(counts.double()).sqrt_().float()
        bits = pack_signs(error)
        error.sub_(decode(bits, scales, block))
    error.index_fill_(0, padding, 0.0)
    return bits, scales


def decode_mean(bits: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over rows of decode(bits[w], scales[w]): rows added in order, then divided (into
    `out` when given: a buffer reused across calls costs no fresh pages)."""
    out = torch.empty(bits.shape[1] * 8, dtype=torch.float32, device=bits.device) if out is None else out
    op = compression_op() if bits.device.type == "cpu" else None
    if op is not None:
        op.decode_mean_(bits.contiguous(), scales.contiguous(), block, out)
        return out
    out.copy_(decode(bits[0], scales[0], block))
    for row in range(1, bits.shape[0]):
        out.add_(decode(bits[row], scales[row], block))
    return out.div_(bits.shape[0])


class CompressedAllReduce:
    """Averages a flat buffer of `layout` over `group` by 1-bit compression with error feedback
    (the module docstring). The worker and server errors are this rank's own: they differ between
    ranks and are saved per rank (state_dict)."""

    def __init__(self, layout: BlockLayout, group, device: torch.device):
        self.layout = layout
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        if self.world != layout.world:
            raise ValueError(f"the layout was cut for {layout.world} ranks, the group has {self.world}")
        self.worker_error = torch.zeros(layout.numel, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(layout.numel // self.world, dtype=torch.float32, device=device)
        self._server_average = torch.empty(layout.numel // self.world, dtype=torch.float32, device=device)
        self.device = device
        self.exclude(None)

    def exclude(self, positions: torch.Tensor | None) -> None:
        """Leave these flat positions out, as padding (None: only the layout's padding): they carry
        nothing, count in no scale and come back zero. The same positions on every rank."""
        layout, block = self.layout, self.layout.block
        extra = torch.empty(0, dtype=torch.long) if positions is None else positions.cpu().long()
        padding = torch.cat([layout.padding, extra])
        counts = (layout.counts - torch.bincount(extra // block, minlength=layout.blocks)).clamp(min=1)
        size, per = layout.numel // self.world, layout.blocks // self.world
        mine = padding[(padding >= self.rank * size) & (padding < (self.rank + 1) * size)] - self.rank * size
        self._counts, self._padding = counts.to(self.device), padding.to(self.device)
        self._server_counts = counts[self.rank * per:(self.rank + 1) * per].to(self.device)
        self._server_padding = mine.to(self.device)

    def average(self, flat: torch.Tensor) -> None:
        """Replace `flat` (this rank's buffer) by the compressed average over the group (the same on
        every rank); excluded positions and padding come back zero. A group of one is left as it is."""
        if self.world == 1:
            return
        flat.index_fill_(0, self._padding, 0.0)
        bits, scales = compress(flat, self.worker_error, self._counts, self._padding, self.layout.block)
        all_bits, all_scales = self.combine(bits, scales)
        decode_mean(all_bits.view(1, -1), all_scales.view(1, -1), self.layout.block, flat)
        flat.index_fill_(0, self._padding, 0.0)

    def combine(self, bits: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Phases 1 and 2 on this rank's compressed buffer (its signs and block scales, the worker
        error already updated, padding and excluded positions zeroed in it): (signs, scales) of the
        average, the same on every rank."""
        block, world = self.layout.block, self.world
        sent = _message(bits.view(world, -1), scales.view(world, -1))
        received = torch.empty_like(sent)
        exchange_chunks(sent, received, self.group, "1-bit momentum (workers)").wait()
        worker_bits, worker_scales = _split(received, bits.numel() // world)
        average = decode_mean(worker_bits, worker_scales, block, self._server_average)
        average.index_fill_(0, self._server_padding, 0.0)
        server_bits, server_scales = compress(average, self.server_error, self._server_counts,
                                              self._server_padding, block)
        gathered = torch.empty_like(sent)
        gathered[self.rank].copy_(_message(server_bits.view(1, -1), server_scales.view(1, -1))[0])
        all_gather_chunks(gathered, self.group, "1-bit momentum (servers)").wait()
        all_bits, all_scales = _split(gathered, bits.numel() // world)
        return all_bits.reshape(-1), all_scales.reshape(-1)

    def state_dict(self) -> dict:
        """This rank's errors (and the layout they follow)."""
        return {"worker_error": self.worker_error, "server_error": self.server_error, "numel": self.layout.numel,
                "world": self.world, "rank": self.rank}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore this rank's errors; None (or errors of another layout) starts them at zero."""
        if state is None or state["numel"] != self.layout.numel or state["world"] != self.world \
                or state["rank"] != self.rank:
            self.worker_error.zero_()
            self.server_error.zero_()
            return
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])


def _message(bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows of [sign bytes | scales as bytes], one row per destination."""
    return torch.cat([bits, scales.contiguous().view(torch.uint8).view(scales.shape[0], -1)], dim=1)


def _split(message: torch.Tensor, bit_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of _message: (sign bytes, scales), one row per sender."""
    bits = message[:, :bit_bytes].contiguous()
    scales = message[:, bit_bytes:].contiguous().view(torch.float32)
    return bits, scales
