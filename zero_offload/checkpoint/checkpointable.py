"""What saving and resuming read from and write into a training run: ``Checkpointable``.

The engine's state view (``engine.state.StateView``) satisfies it; checkpoint code names only
this, so it depends on nothing above the parts it shares with the engine (units, the process
group, the state policy) and the engine can change how it holds its state without the
checkpoint format noticing."""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Protocol

import torch
import torch.nn as nn

from ..comm import Comm
from ..optim.policy import StatePolicy
from ..params.units import FlatUnit

__all__ = ["Checkpointable"]


class Checkpointable(Protocol):
    """A training run's state as checkpoints see it: its layout (units, world, stage, dtype),
    the optimizer state streamed out and restored unit by unit, and the counters and
    hyperparameters a resume needs."""

    @property
    def comm(self) -> Comm: ...
    @property
    def module(self) -> nn.Module: ...
    @property
    def units(self) -> list[FlatUnit]: ...
    @property
    def shard_numel(self) -> int: ...
    @property
    def stage(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def state_policy(self) -> StatePolicy: ...
    @property
    def global_steps(self) -> int: ...
    @property
    def optimizer_steps(self) -> int: ...

    # -- saving --------------------------------------------------------------------------
    def state_chunks(
        self,
    ) -> Iterator[tuple[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]]:
        """This rank's state as (rank-flat offset, [fp32 master, exp_avg, exp_avg_sq]) in
        increasing offset order; moments None for frozen units' values."""
        ...

    def native_state(self) -> dict[str, torch.Tensor] | None:
        """The state as stored where fp32 sections do not hold it exactly; else None."""
        ...

    def training_state(self) -> dict[str, Any]:
        """Counters and optimizer hyperparameters (plain data)."""
        ...

    # -- resuming ------------------------------------------------------------------------
    def load_unit_state(
        self, unit: FlatUnit, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor
    ) -> None: ...
    def load_native_state(self, tensors: Mapping[str, torch.Tensor]) -> None: ...
    def finish_load(self) -> None: ...
    def load_training_state(self, state: Mapping[str, Any]) -> None: ...
