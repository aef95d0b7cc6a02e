"""What every updater is: the base class the engine, the stepper and the checkpoint code talk
to, whatever the optimizer kind and wherever its state lives.

The abstract methods are what each updater must say for itself. The rest have the answers
of an updater that keeps its state in memory as fp32 AdamW: nothing to check before a step,
no state beyond the fp32 chunks, no pass during backward, no files. An updater that differs
overrides them, so the engine asks one question of every updater and never probes which
kind it holds.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar, Iterator, Mapping

import torch

from ..memory.ledger import MemoryReport
from .api import Sink, StateChunk, StepRange, StepTimings, Targets

if TYPE_CHECKING:
    from ..grads.disk import DiskGrads
    from ..swap.swapper import Swapper
    from .nvme.early import EarlyUpdate
    from .nvme.sizing import OptimizerSplit

__all__ = ["Updater"]


class Updater(abc.ABC):
    """The rank-flat optimizer state and its update.

    ``runs_under_forward``: the update is disk-bound and steps sub-group by sub-group
    (:meth:`update_in_steps`), so ``overlap_step`` runs it under the next forward; an
    updater in memory is stepped at ``step()``, where nothing waits for a disk.
    """

    runs_under_forward: ClassVar[bool] = False
    steps: int
    last_timings: StepTimings
    optimizer: torch.optim.Optimizer
    """The torch-facing optimizer: its ``param_groups`` carry the hyperparameters that lr
    schedulers change."""
    disk_grads: DiskGrads | None = None
    """The gradient shard in files, summed there during backward (NVMe optimizer whose host
    budget cannot hold it); None: the engine holds the gradients."""
    swapper: Swapper | None = None
    """The swap manager of state kept in files; None: the state is in memory."""
    split: OptimizerSplit | None = None
    """How state on NVMe is placed (host share, sub-groups); None: not on NVMe."""

    # -- what each updater says for itself ------------------------------------------------
    @abc.abstractmethod
    def load_state(
        self,
        offset: int,
        master: torch.Tensor,
        exp_avg: torch.Tensor | None = None,
        exp_avg_sq: torch.Tensor | None = None,
    ) -> None:
        """Store fp32 state given in increasing, gap-free ``offset`` order (moments default
        to zeros)."""

    @abc.abstractmethod
    def iter_state(self) -> Iterator[StateChunk]:
        """The state as fp32 chunks, in rank-flat order."""

    @abc.abstractmethod
    def update(
        self,
        grads: torch.Tensor | None,
        factor: float,
        sink: Sink,
        ranges: list[StepRange] | None = None,
        targets: Targets | None = None,
    ) -> None:
        """Step rank-flat ``ranges`` (lo, hi, step count, weight decay or not; None:
        everything at ``steps + 1`` with weight decay) with ``grads × factor``, leave the
        rest as it is, hand every value to ``sink`` (or write it into its ``targets``
        piece, where the updater takes them); ``steps`` becomes ``steps + 1``."""

    @abc.abstractmethod
    def master_values(self) -> torch.Tensor:
        """A host fp32 copy of the whole master."""

    @abc.abstractmethod
    def add_to(self, report: MemoryReport) -> None:
        """Count the bytes it holds, by tier, into ``report``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Give back buffers and files."""

    # -- what an fp32 updater in memory answers -------------------------------------------
    def update_in_steps(
        self,
        grads: torch.Tensor | None,
        factor: float,
        sink: Sink,
        ranges: list[StepRange] | None = None,
        targets: Targets | None = None,
        early: EarlyUpdate | None = None,
    ) -> Iterator[int]:
        """:meth:`update`, one sub-group per iteration, each yielding the rank-flat end of
        the values handed to ``sink`` so far; only updaters that ``runs_under_forward``
        (the stepper asks nothing else of the rest)."""
        raise NotImplementedError(f"{type(self).__name__} steps whole, at step()")

    def start_early(
        self,
        grads: torch.Tensor | None,
        factor: float,
        ranges: list[StepRange] | None,
        unit_starts: list[int],
    ) -> EarlyUpdate | None:
        """Start stepping state during the final backward as gradients land; None: this
        updater steps at ``step()`` only."""
        return None

    def ensure_sound(self, what: str) -> None:
        """Raise when an earlier failed step left the state partly updated (only state in
        files can be: memory is stepped whole)."""
        return None

    def resident_tensors(self) -> dict[str, torch.Tensor]:
        """The state tensors held in memory, by role; empty when they are in files."""
        return {}

    def native_tensors(self) -> dict[str, torch.Tensor] | None:
        """The state as stored, by array name, where the fp32 chunks of :meth:`iter_state`
        do not hold it exactly (8-bit codes, a bf16 master); None: they do."""
        return None

    def load_native(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`native_tensors`."""
        raise TypeError(f"{type(self).__name__} keeps fp32 state: it loads through load_state")

    def param_values(self, lo: int, hi: int) -> torch.Tensor:
        """The parameters that rank-flat [lo, hi) of the master gives (after
        :meth:`load_native`)."""
        raise TypeError(f"{type(self).__name__} keeps fp32 state: it loads through load_state")
