"""DeepSpeed's name for megazero.activation_checkpointing: `megazero.checkpointing.checkpoint(function,
*args)` and `megazero.checkpointing.configure(mpu, ...)`."""

from megazero.activation_checkpointing import checkpoint, configure

__all__ = ["checkpoint", "configure"]
