"""Point-to-point exchange of activations and their gradients between neighbouring stages.

Every message is a small shape header followed by the tensor, both with isend/irecv, so it works
the same on gloo and NCCL and the receiver needs no prior knowledge of the shape. The combined
operations post their send and their receive before waiting on either, so two neighbours that
send to each other at the same moment (1F1B's steady state) cannot deadlock.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.watchdog import watched

_MAX_DIMS = 8


class StageLinks:
    """This rank's previous and next stage (global ranks) in its pipeline, and the tensor dtype/device."""

    def __init__(self, pp_ranks: list[int], pp_rank: int, group, dtype: torch.dtype, device: torch.device,
                 timers=None):
        self.prev = pp_ranks[pp_rank - 1] if pp_rank > 0 else None
        self.next = pp_ranks[pp_rank + 1] if pp_rank + 1 < len(pp_ranks) else None
        self.group, self.dtype, self.device = group, dtype, device
        self.timer = timers("pipe_send_recv") if timers is not None else None  # time spent exchanging

    def _timed(self, fn, *args):
        if self.timer is None:
            return fn(*args)
        self.timer.start()
        try:
            return fn(*args)
        finally:
            self.timer.stop()

    def _header(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"pipeline messages support up to {_MAX_DIMS} dimensions, got {tensor.dim()}")
        header = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64, device=self.device)
        header[0] = tensor.dim()
        header[1:1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        return header

    def _isend(self, tensor: torch.Tensor, peer: int) -> list:
        tensor = tensor.detach().contiguous()
        return [dist.isend(self._header(tensor), peer, group=self.group), dist.isend(tensor, peer, group=self.group)]

    def _recv(self, peer: int) -> torch.Tensor:
        header = torch.empty(_MAX_DIMS + 1, dtype=torch.int64, device=self.device)
        dist.recv(header, peer, group=self.group)
        shape = header[1:1 + int(header[0])].tolist()
        tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
        dist.recv(tensor, peer, group=self.group)
        return tensor

    @staticmethod
    def _wait(works: list) -> None:
        for work in works:
            work.wait()

    @watched("p2p recv forward (the previous stage's output)")
    def recv_forward(self) -> torch.Tensor:
        """The previous stage's output (this stage's input), as a leaf that will receive a gradient."""
        return self._timed(self._recv, self.prev).requires_grad_()

    @watched("p2p send forward (to the next stage)")
    def send_forward(self, output: torch.Tensor) -> None:
        """Send this stage's output to the next stage."""
        self._timed(lambda: self._wait(self._isend(output, self.next)))

    @watched("p2p recv backward (the next stage's gradient)")
    def recv_backward(self) -> torch.Tensor:
        """The gradient of this stage's output, from the next stage."""
        return self._timed(self._recv, self.next)

    @watched("p2p send backward (to the previous stage)")
    def send_backward(self, input_grad: torch.Tensor) -> None:
        """Send the gradient of this stage's input to the previous stage."""
        self._timed(lambda: self._wait(self._isend(input_grad, self.prev)))

    @watched("p2p send forward / recv backward (with the next stage)")
    def send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor:
        """Send the output on while receiving the gradient of an earlier output."""
        return self._timed(self._exchange, output, self.next)

    @watched("p2p send backward / recv forward (with the previous stage)")
    def send_backward_recv_forward(self, input_grad: torch.Tensor) -> torch.Tensor:
        """Send an input gradient back while receiving the next input."""
        return self._timed(self._exchange, input_grad, self.prev).requires_grad_()

    def _exchange(self, tensor: torch.Tensor, peer: int) -> torch.Tensor:
        works = self._isend(tensor, peer)  # posted before the receive: neighbours never wait on each other
        received = self._recv(peer)
        self._wait(works)
        return received
