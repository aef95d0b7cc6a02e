"""What a pass during backward and one update's step need of the NVMe optimizer they run
for, so that :class:`~.early.EarlyUpdate`, :class:`~.adam_step.AdamStep` and
:class:`~.adam.NvmeAdam` need not import each other.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ...device.threads import ThreadBudget
from ...grads.disk import DiskGrads
from ...swap.swapper import Swapper
from .group_step import GroupStep
from .pipeline import SubGroupPipeline

__all__ = ["AdamFiles", "SubGroupFiles"]


class SubGroupFiles(Protocol):
    """Sub-groups of a rank-flat optimizer state, those not ``on_host`` in files."""

    BUFFERS: int  # pool buffers a read ahead needs beside the one stepped
    numel: int
    steps: int  # updates applied so far
    bounds: list[tuple[int, int]]
    on_host: tuple[bool, ...]  # per sub-group: its state is in host memory, not a file
    swapper: Swapper
    group_step: GroupStep
    threads: ThreadBudget

    def state_key(self, i: int) -> str:
        """The swapper key of sub-group ``i``'s [master | m | v]."""
        ...

    def early_ended(self, early: object) -> None:
        """The pass ``early`` has stopped: the optimizer no longer holds it."""
        ...


class AdamFiles(SubGroupFiles, Protocol):
    """What one update's :class:`~.adam_step.AdamStep` needs of :class:`~.adam.NvmeAdam`."""

    disk_grads: DiskGrads | None  # the gradient shard in files (None: in host memory)
    out_itemsize: int  # bytes a parameter of the new values stored during backward
    pipeline: SubGroupPipeline

    def host_view(self, i: int) -> torch.Tensor | None:
        """Sub-group ``i``'s (3, n) [master | m | v] where it lives in host memory."""
        ...
