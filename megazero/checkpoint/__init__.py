"""Training-state checkpoints: atomic, pickle-free files and the engine's state in them (activation
checkpointing, the recomputation, is megazero/activation_checkpointing.py)."""

from megazero.checkpoint.io import (
    CheckpointError,
    atomic_checkpoint_dir,
    load_file,
    read_latest,
    save_file,
)

__all__ = ["CheckpointError", "atomic_checkpoint_dir", "load_file", "read_latest", "save_file"]
