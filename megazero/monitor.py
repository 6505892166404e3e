"""One interface for TensorBoard and wandb scalars; only rank 0 writes."""

from __future__ import annotations

import os

from megazero.config import TensorBoardConfig, WandbConfig


class Monitor:
    """`write(step, {name: value})` to every enabled backend; `close()` flushes them."""

    def __init__(self, tensorboard: TensorBoardConfig, wandb: WandbConfig, rank: int = 0):
        self.rank = rank
        self._tb = None
        self._wandb = None
        if rank != 0:
            return
        if tensorboard.enabled:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = os.path.join(tensorboard.output_path or "runs", tensorboard.job_name)
            self._tb = SummaryWriter(log_dir=log_dir)
            self.tensorboard_dir = log_dir
        if wandb.enabled:
            import wandb as wandb_lib

            # offline unless the user gave a key or chose a mode: no network calls by surprise
            if "WANDB_MODE" not in os.environ and not os.environ.get("WANDB_API_KEY"):
                os.environ["WANDB_MODE"] = "offline"
            self._wandb = wandb_lib.init(project=wandb.project, entity=wandb.team, group=wandb.group)

    @property
    def enabled(self) -> bool:
        """True when at least one backend writes on this rank."""
        return self._tb is not None or self._wandb is not None

    def write(self, step: int, scalars: dict[str, float]) -> None:
        """Record scalars at `step` (e.g. Megatron's 'lm loss', 'learning-rate')."""
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.log(dict(scalars), step=step)

    def flush(self) -> None:
        """Push buffered events to disk."""
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flush and close every backend."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
