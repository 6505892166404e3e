"""An alias, not code: DeepSpeed's name for activation checkpointing, so that DeepSpeed's
`deepspeed.checkpointing.checkpoint(function, *args)` and `deepspeed.checkpointing.configure(mpu, ...)`
run as `megazero.checkpointing.checkpoint/configure`.

The implementation is megazero/activation_checkpointing.py (use that name in new code); this module
re-exports its public objects, the same ones. Training-state checkpoints (save_checkpoint,
load_checkpoint, the files) are the other meaning of the word, in megazero/checkpoint/.
"""

from megazero.activation_checkpointing import (
    SYNCHRONIZE_RANGE,
    checkpoint,
    checkpoint_stats,
    configure,
    settings,
)

__all__ = ["SYNCHRONIZE_RANGE", "checkpoint", "checkpoint_stats", "configure", "settings"]
