"""What a pass during backward needs of the NVMe optimizer it runs beside, so that
:class:`~.early.EarlyUpdate` and :class:`~.adam.NvmeAdam` need not import each other.
"""

from __future__ import annotations

from typing import Protocol

from ...device.threads import ThreadBudget
from ...swap.swapper import Swapper
from .group_step import GroupStep

__all__ = ["SubGroupFiles"]


class SubGroupFiles(Protocol):
    """Sub-groups of a rank-flat optimizer state, those from ``host_groups`` on in files."""

    BUFFERS: int  # pool buffers a read ahead needs beside the one stepped
    numel: int
    steps: int  # updates applied so far
    bounds: list[tuple[int, int]]
    host_groups: int
    swapper: Swapper
    group_step: GroupStep
    threads: ThreadBudget

    def state_key(self, i: int) -> str:
        """The swapper key of sub-group ``i``'s [master | m | v]."""
        ...

    def early_ended(self, early: object) -> None:
        """The pass ``early`` has stopped: the optimizer no longer holds it."""
        ...
