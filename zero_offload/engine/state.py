"""What an engine offers to read and restore its training state: the accessors checkpoints
use (``zero_offload.checkpoint`` reaches a run only through :class:`StateView`, which satisfies
its ``Checkpointable``, as it does the exports' ``Exportable``) and read-only views of the last
step for users, benchmarks and tests, which the engine passes on."""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch
import torch.nn as nn

from ..activations.offload import ActivationOffload
from ..comm import Comm
from ..config import ZeroConfig
from ..device.streams import Streams
from ..grads.host import HostGradQueue
from ..grads.reducer import GradReducer
from ..memory.ledger import MemoryReport
from ..optim.policy import StatePolicy
from ..params.gather import ParamGatherer
from ..params.store import ParamStore
from ..params.unit_state import UnitStates
from ..params.units import FlatUnit
from ..policies import Stage
from ..update.window import WindowCoordinator
from . import export

if TYPE_CHECKING:
    from ..swap.swapper import Swapper
    from ..update.api import StepTimings
    from ..update.nvme.sizing import OptimizerSplit
    from ..update.stepper import ShardStepper
    from .build import Parts
    from .lifecycle import Lifecycle
    from .steps import StepRecord

__all__ = ["StateArrays", "StateView"]

# a piece of the optimizer state: fp32 master, exp_avg, exp_avg_sq (moments None: frozen)
StateArrays = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class StateView:
    """A run's training state as checkpoints, exports and users read it: the shared ``parts``
    (units, stepper, gradients...), the step ``record`` with its counters, and the model's
    layout. ``lifecycle`` refuses a closed engine and settles an update left running;
    ``zero_grad`` drops accumulated gradients once a load is finished."""

    def __init__(
        self,
        module: nn.Module,
        config: ZeroConfig,
        comm: Comm,
        device: torch.device,
        streams: Streams,
        parts: Parts,
        record: StepRecord,
        lifecycle: Lifecycle,
        zero_grad: Callable[[], None],
    ) -> None:
        self.module = module
        self.config = config
        self.comm = comm
        self.device = device
        self.streams = streams
        self.record = record
        self._parts = parts
        self._lifecycle = lifecycle
        self._zero_grad = zero_grad  # the training loop's

    # -- the run's layout and parts -------------------------------------------------------
    @property
    def stage(self) -> int:
        return self.config.stage

    @property
    def sharding(self) -> Stage:
        return self.config.sharding

    @property
    def dtype(self) -> torch.dtype:
        return self.config.precision.dtype

    @property
    def units(self) -> list[FlatUnit]:
        return self._parts.units

    @property
    def shard_numel(self) -> int:
        return self._parts.shard_numel

    @property
    def trainable_numel(self) -> int:
        return self._parts.trainable_numel

    @property
    def stepper(self) -> ShardStepper:
        return self._parts.stepper

    @property
    def reducer(self) -> GradReducer:
        return self._parts.reducer

    @property
    def param_store(self) -> ParamStore | None:
        return self._parts.param_store

    @property
    def unit_states(self) -> UnitStates:
        return self._parts.unit_states

    @property
    def grads(self) -> torch.Tensor | None:
        return self._parts.grads

    @property
    def grad_queue(self) -> HostGradQueue | None:
        return self._parts.grad_queue

    @property
    def activations(self) -> ActivationOffload | None:
        return self._parts.activations

    @property
    def gatherer(self) -> ParamGatherer | None:
        return self._parts.gatherer

    @property
    def coordinator(self) -> WindowCoordinator:
        return self._parts.coordinator

    @property
    def global_steps(self) -> int:
        return self.record.global_steps

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over this rank's fp32 master shard; pass it to lr schedulers."""
        self._lifecycle.check_open(settle=False)  # an update running on took its hyperparameters
        return self.stepper.optimizer

    @property
    def loss_scale(self) -> float:
        return self.stepper.loss_scale

    # -- checkpoints and exports (``zero_offload.checkpoint`` sits above the engine) -----------
    def save_checkpoint(
        self, directory: str | os.PathLike, tag: str | None, lr_scheduler: Any
    ) -> os.PathLike:
        """See :meth:`zero_offload.Engine.save_checkpoint`."""
        self._lifecycle.check_open()
        # a broken state says so first: load_checkpoint fixes it
        self.stepper.updater.ensure_sound("save a checkpoint")
        if self.reducer.backwards:
            raise RuntimeError(
                f"save_checkpoint: {self.reducer.backwards} backward(s) accumulated gradients "
                "that no step() has applied yet, and a checkpoint does not carry gradients: "
                "save at an accumulation boundary, after the step() that applies them "
                "(engine.is_accumulation_boundary is True before the backward whose step() "
                "updates), or call engine.zero_grad() first to drop them"
            )
        from ..checkpoint import save_checkpoint

        return save_checkpoint(self, directory, tag, lr_scheduler)

    def load_checkpoint(
        self, directory: str | os.PathLike, tag: str | None, lr_scheduler: Any, convert: bool
    ) -> str:
        """See :meth:`zero_offload.Engine.load_checkpoint`."""
        self._lifecycle.check_open()
        from ..checkpoint import load_checkpoint

        return load_checkpoint(self, directory, tag, lr_scheduler, convert)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """See :meth:`zero_offload.Engine.full_state_dict`."""
        self._lifecycle.check_open()
        return export.full_state_dict(self)

    def frozen_shard(self, unit: FlatUnit) -> torch.Tensor:
        """See :meth:`zero_offload.Engine.frozen_shard`."""
        return export.frozen_shard(self, unit)

    def memory_report(self) -> MemoryReport:
        """See :meth:`zero_offload.Engine.memory_report`."""
        self._lifecycle.check_open()
        return export.memory_report(self)

    # -- what checkpoints read and restore (``zero_offload.checkpoint`` uses only these) -----
    def state_chunks(self) -> Iterator[tuple[int, StateArrays]]:
        """(rank-flat offset, [master, exp_avg, exp_avg_sq]) fp32 CPU pieces in increasing
        offset order: the optimizer's state streamed from its tier, then each frozen unit's
        values with moments that are zero (None)."""
        self._lifecycle.check_open()
        for lo, _hi, master, exp_avg, exp_avg_sq in self.stepper.updater.iter_state():
            yield lo, (master, exp_avg, exp_avg_sq)
        for unit in sorted((u for u in self.units if u.frozen), key=lambda u: u.shard_offset):
            yield unit.shard_offset, (self.frozen_shard(unit), None, None)

    def load_unit_state(
        self, unit: FlatUnit, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor
    ) -> None:
        """Restore one unit's shard: optimizer state (trainable units) and parameters."""
        self._lifecycle.check_open()
        if not unit.frozen:
            self.stepper.updater.load_state(unit.shard_offset, master, exp_avg, exp_avg_sq)
        self.stepper.sink.write(unit, master)

    @property
    def state_policy(self) -> StatePolicy:
        """The optimizer's kind and state precisions."""
        return self.config.optimizer.policy

    def native_state(self) -> dict[str, torch.Tensor] | None:
        """This rank's optimizer state as stored, by array name (8-bit codes, absmax, side
        arrays, a bf16 master and its compensation), for a policy the fp32 sections of
        :meth:`state_chunks` do not hold exactly; None for fp32 AdamW (they do)."""
        self._lifecycle.check_open()
        return self.stepper.updater.native_tensors()

    def load_native_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`native_state` saved at this rank, world size, stage and policy
        (after the units are loaded: it replaces their optimizer state bit for bit)."""
        self._lifecycle.check_open()
        updater = self.stepper.updater
        updater.load_native(tensors)
        for unit in self.units:  # the parameters the restored master gives, as a step does
            if not unit.frozen:
                lo = unit.shard_offset
                self.stepper.sink.write(unit, updater.param_values(lo, lo + unit.shard_numel))

    def finish_load(self) -> None:
        """After every :meth:`load_unit_state`: parameters are in place, gradients empty."""
        if self.param_store is not None:
            self.param_store.flush()
        self._zero_grad()

    def training_state(self) -> dict[str, Any]:
        """Counters and optimizer hyperparameters a resume needs (plain data)."""
        opt = self.stepper
        return {
            "micro_steps": self.record.micro_steps,
            "global_steps": self.record.global_steps,
            "optimizer_steps": self.optimizer_steps,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
            ],
            "loss_scaler": opt.scaler.state_dict() if opt.scaler else None,
            "missed_updates": self.missed_updates(),
        }

    def load_training_state(self, state: Mapping[str, Any]) -> None:
        self.record.micro_steps = state["micro_steps"]
        self.record.global_steps = state["global_steps"]
        self.optimizer_steps = state["optimizer_steps"]
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"]):
            group.update(saved)
        self.load_missed_updates(state.get("missed_updates", {}))  # absent: older files
        scaler = self.stepper.scaler
        if scaler is not None and state["loss_scaler"] is not None:
            scaler.load_state_dict(state["loss_scaler"])

    @property
    def optimizer_steps(self) -> int:
        """Updates applied to the optimizer state (Adam's bias-correction step)."""
        self.coordinator.settle()
        return self.stepper.updater.steps

    @optimizer_steps.setter
    def optimizer_steps(self, value: int) -> None:
        self.stepper.updater.steps = value

    # -- read-only views for users, benchmarks and tests -------------------------------------
    def missed_updates(self) -> dict[str, int]:
        """Parameter name -> updates it had no gradient for (nonzero ones only)."""
        return self.stepper.missed_updates()

    def load_missed_updates(self, by_name: Mapping[str, int]) -> None:
        self.stepper.load_missed_updates(by_name)

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer-state tensors this rank holds in memory, by role (master, exp_avg,
        exp_avg_sq); empty with the state on NVMe."""
        return self.stepper.updater.resident_tensors()

    def reductions_in_flight(self) -> list[torch.Tensor]:
        """The buffers of gradient reductions not yet waited for (flat input and output)."""
        return self.reducer.inflight_buffers()

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds right now, by kind: ``units`` (flat compute-dtype
        buffers kept whole), ``gathered`` (stage 3's gathered units), ``param_shards`` (stage
        3's shards between uses), ``param_grads`` (each ``param.grad``), ``grad_shard`` (the
        reduced gradients the optimizer steps from), ``optimizer`` (its state in memory),
        ``comm`` (reductions in flight) and ``activations`` (offloaded, and copies brought
        back). A memory tracker (the rehearsal) names each storage it sees by these."""
        store = self.param_store
        return {
            "units": [u.full for u in self.units if not u.sharded_params],
            "gathered": [u.full for u in self.units if u.sharded_params],
            "param_shards": [store.resident] if store and store.resident is not None else [],
            "param_grads": [p.grad for u in self.units for p in u.params if p.grad is not None],
            "grad_shard": [self.grads] if self.grads is not None else [],
            "optimizer": list(self.optimizer_tensors().values()),
            "comm": self.reductions_in_flight(),
            "activations": self.activations.held_tensors() if self.activations else [],
        }

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (None without ``max_grad_norm``)."""
        return self.stepper.last_grad_norm

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far: on a float16 overflow, or on inf/NaN gradients with
        ``skip_nonfinite_steps``."""
        scaler = self.stepper.scaler
        return scaler.skipped_steps if scaler else 0

    @property
    def last_step_timings(self) -> StepTimings:
        """Seconds and bytes of the last optimizer update (I/O, compute, overlap)."""
        self.coordinator.settle()
        return self.stepper.updater.last_timings

    @property
    def sharded_optimizer(self) -> ShardStepper:
        """Deprecated name of the engine's stepper, for scripts written against it. Read
        ``last_step_timings``, ``last_grad_norm`` or ``optimizer_steps`` instead. It does
        not wait for an update running under the forward."""
        warnings.warn(
            "engine.sharded_optimizer is deprecated and will be removed; read "
            "engine.last_step_timings, engine.last_grad_norm or engine.optimizer_steps",
            DeprecationWarning,
            stacklevel=3,  # the caller of engine.sharded_optimizer
        )
        return self.stepper

    @property
    def update_progress(self) -> tuple[int, int] | None:
        """While the last step's update runs under the forward (``overlap_step``): elements
        of this rank's shard whose new values are stored, and elements in all; None when no
        update is running."""
        pending = self.coordinator.pending
        if pending is None:
            return None
        return pending.stored, sum(u.shard_numel for u in self.units if not u.frozen)

    @property
    def optimizer_split(self) -> OptimizerSplit | None:
        """How the NVMe optimizer places its state (``offload_optimizer_fraction``): elements
        in host memory and in files, its sub-group size; None when it is not on NVMe."""
        return self.stepper.updater.split

    @property
    def swappers(self) -> list[Swapper]:
        """The swap managers this rank uses (NVMe tiers): optimizer state, then parameters."""
        found = [
            self.stepper.updater.swapper,
            None if self.param_store is None else self.param_store.swapper,
        ]
        return [s for s in found if s is not None]

    # -- what the last step did ------------------------------------------------------------
    @property
    def last_comm(self) -> dict:
        """Collective counters of the last step."""
        return dict(self.record.comm)

    @property
    def last_step_peak(self) -> int:
        """Stage 3: the peak gathered parameter bytes of the last step."""
        return self.record.peak
