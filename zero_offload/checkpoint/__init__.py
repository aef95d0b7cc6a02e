"""Save, resume exactly, consolidate: sharded checkpoints with offloaded state included."""

from .consolidate import consolidate_checkpoint
from .format import CheckpointError
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate_checkpoint", "CheckpointError"]
