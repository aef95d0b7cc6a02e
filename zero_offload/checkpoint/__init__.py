"""Save, resume exactly, consolidate: sharded checkpoints with offloaded state included; resume
from DeepSpeed ZeRO and DCP (FSDP2) checkpoints, and export to DCP."""

from .convert import consolidate_checkpoint, import_deepspeed
from .dcp_export import export_dcp
from .format import CheckpointError
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "consolidate_checkpoint",
    "import_deepspeed",
    "export_dcp",
    "CheckpointError",
]
