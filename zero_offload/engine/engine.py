"""The training engine: ZeRO stages 0–3 around an ordinary ``torch.nn.Module``.

``initialize(model, **kwargs)`` validates the configuration, flattens the model's parameters
into units (``params.units``), and wires three parts together: the gradient reducer
(``grads.reducer``), the sharded optimizer (``update.stepper``) and, in stage 3, the parameter
gatherer (``params.gather``). The model's own parameters become views into the units' flat
buffers, so the user's module runs unchanged. The model's calls through the engine live in
``engine.forward``, closing and lending parameters their values in ``engine.lifecycle``, the
accessors checkpoints and users read in ``engine.state``.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Mapping

import torch
import torch.nn as nn

from ..comm import Comm
from ..config import ZeroConfig, build_config
from ..deepspeed_config import schedule
from ..device import placement
from ..device.threads import ThreadBudget
from ..interrupts import signals_held
from ..memory.ledger import MemoryReport
from ..params.units import FlatUnit, persistent_buffers
from ..swap.budget import return_freed_memory
from ..update.window import Phase
from ..weak import weak_hook
from . import export
from .forward import EngineForward, ForwardWindow
from .lifecycle import EngineLifecycle, Leftovers, check_parameters
from .optimizer_state import attach_state_dict
from .parts import Runtime, build_parts
from .preemption import Preemption
from .state import EngineState
from .step_stats import StepRecord

__all__ = ["Engine", "initialize", "persistent_buffers"]

log = logging.getLogger(__name__)


class Engine(EngineForward, EngineLifecycle, EngineState):
    """Runs forward/backward/step of one data-parallel rank. Build it with :func:`initialize`."""

    def __init__(
        self, model: nn.Module, config: ZeroConfig, runtime: Runtime | None = None
    ) -> None:
        """``runtime``: the machine-facing parts (side streams, the host gradient worker, the
        device optimizer); None: the real ones. A rehearsal passes simulated ones."""
        self.config = config
        self._runtime = runtime = runtime or Runtime()
        self._closed = True  # until checked
        check_parameters(model)
        self.comm = Comm(config.process_group)
        self.device = placement.select_device(config.device)
        # threads per kind of CPU work, decided once for this rank (device.threads)
        self.threads = ThreadBudget.decide(self.device.type, config.threads)
        self.threads.apply_compute()
        self.dtype = config.precision.dtype
        self.stage = config.stage
        self.sharding = config.sharding  # what the stage shards, for the parts
        self._module = model
        self.streams = runtime.streams(self.device)
        # What must be released however this engine ends (close(), collection, exit, or an
        # error below); it holds nothing that refers back to the engine.
        self._leftovers = Leftovers()
        self._finalizer = weakref.finalize(self, self._leftovers.release)
        self._closed = False
        try:
            self._build(model, config)
        except BaseException:
            self._closed = True  # a half-built engine is not usable
            self._finalizer()
            raise

    def _build(self, model: nn.Module, config: ZeroConfig) -> None:
        parts = build_parts(
            model,
            config,
            self.comm,
            self.device,
            self.threads,
            self.streams,
            self._runtime,
            self._leftovers,
            weak_hook(self._host_grads_widened),  # weak: parts must not keep the engine alive
        )
        self.param_store, self.units = parts.param_store, parts.units
        self.trainable_numel, self.shard_numel = parts.trainable_numel, parts.shard_numel
        self.grads, self.grad_queue = parts.grads, parts.grad_queue
        self.unit_states, self.gatherer = parts.unit_states, parts.gatherer
        self.reducer, self.activations = parts.reducer, parts.activations
        self.stepper, self.coordinator = parts.stepper, parts.coordinator
        attach_state_dict(self)  # engine.optimizer.state_dict() holds the state of every tier
        # a DeepSpeed config's lr schedule, stepped after each applied update as DeepSpeed does
        self.lr_scheduler = schedule(self.optimizer, config.lr_schedule)
        # save_on_preemption: SIGTERM/SIGINT end the run at an agreed step (engine.preemption)
        self.preemption = Preemption(self.comm, self.device) if config.save_on_preemption else None
        if self.preemption is not None:
            self._leftovers.closers.append(self.preemption.close)
        self.micro_steps = 0
        self.global_steps = 0
        self.record = StepRecord()  # what the last step did (engine.last_step)
        self._window = ForwardWindow(weak_hook(self._forward_context))
        # model(x) is engine(x): the window opens before the root's other pre-forward hooks
        self._leftovers.closers[:0] = self._window.hook_root(
            model, weak_hook(self._root_pre_forward)
        )
        log.info(
            "zero_offload: stage %d, %d units, rank %d/%d, %s on %s",
            self.stage,
            len(self.units),
            self.comm.rank,
            self.comm.world_size,
            self.dtype,
            self.device,
        )

    def _host_grads_widened(self, grads: torch.Tensor) -> None:
        """The host gradient shard became fp32 (a second backward before a step)."""
        self.grads = self.stepper.grads = grads

    # -- the model's face ----------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def training(self) -> bool:
        return self._module.training

    def train(self, mode: bool = True) -> "Engine":
        """``module.train(mode)``, as on the model."""
        self._module.train(mode)
        return self

    def eval(self) -> "Engine":
        """``module.eval()``, as on the model."""
        self._module.eval()
        return self

    # -- the training loop ------------------------------------------------------------------

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over this rank's fp32 master shard; pass it to lr schedulers."""
        self._check_open(settle=False)  # an update running on took its hyperparameters
        return self.stepper.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.stepper.loss_scale

    @property
    def is_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, *, final: bool | None = None) -> None:
        """Backpropagate ``loss`` (scaled by 1/gradient_accumulation_steps, and by the loss
        scale with float16); gradients are averaged over ranks. ``final``: this backward ends
        the accumulation window (default: counted from gradient_accumulation_steps; trainers
        that count micro-steps themselves pass it, with gradient_accumulation_steps=1)."""
        self._check_open()
        if loss.numel() != 1:
            raise ValueError(f"backward needs a scalar loss, got shape {tuple(loss.shape)}")
        with self.coordinator.during(Phase.BACKWARD):
            self._backward(loss, self.is_accumulation_boundary if final is None else final)

    def _backward(self, loss: torch.Tensor, final: bool) -> None:
        scale = self.loss_scale / self.config.gradient_accumulation_steps
        self.reducer.begin_backward(final=final)
        self.stepper.begin_backward(final)
        self.reducer.on_landed = self.stepper.landing()
        if self.gatherer:
            self.gatherer.begin_backward()
        if self.activations is not None:
            self.activations.begin_backward()
        if final:
            # Freed heap pages go back now, while the heap is at its fullest: the pages the
            # activations hold stay resident for the next forward to reuse, where returning
            # them after the step would have that forward fault each of them in again.
            return_freed_memory()
        try:
            with self.record.clock.phase("backward"):
                (loss * scale if scale != 1.0 else loss).backward()
                self.reducer.end_backward()
        except BaseException:
            self.coordinator.drop_early()
            raise
        finally:
            if self.gatherer:
                self.gatherer.end_backward()

    def step(self) -> bool:
        """Count a micro-step; at the accumulation boundary reduce, clip and apply the update.
        Returns True when an update was applied (False between boundaries, on overflow, or
        when no parameter had a gradient since the last update: nothing is stepped then,
        like ``torch.optim.AdamW`` skips parameters whose ``.grad`` is None). A SIGINT or
        SIGTERM that arrives meanwhile is raised once the step has ended (docs/preemption.md)."""
        boundary = self.is_accumulation_boundary
        with signals_held():
            applied = self._step()
        if boundary and self.preemption is not None:
            # collective, after a step that ended a window
            self.preemption.stop_if_agreed(
                self.config.save_on_preemption, self.save_checkpoint, self.close
            )
        return applied

    @property
    def preempted(self) -> int:
        """The signal the ranks agreed to stop for at the last ``step()`` (0: none), with
        ``save_on_preemption``."""
        return 0 if self.preemption is None else self.preemption.agreed

    def _step(self) -> bool:
        self._check_open()
        boundary = self.is_accumulation_boundary
        self.micro_steps += 1
        with self.coordinator.during(Phase.STEP):
            if not boundary:
                self.coordinator.drop_early()  # a backward passed final=True off the boundary
                return False
            return self._update()

    def _update(self) -> bool:
        """The step at a boundary: reduce, update, record what it did."""
        with self.record.clock.phase("step"):
            flags = self.reducer.reduce_accumulated()
            applied = self.stepper.step(
                flags, self.reducer.reduce_late, defer=weak_hook(self._end_deferred_update)
            )
            if self.coordinator.pending is None:
                self._end_update()
        self.coordinator.cleared()
        if applied:
            self.global_steps += 1
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.record.step_ended(self, applied)
        if self.gatherer or self.coordinator.boundaries == 1:
            # Stage 3: the pages of the units the backward released go back before the
            # reads ahead for the next step take fresh blocks, which would leave RSS
            # wandering with them. Any stage, once: the first step laid its blocks out while
            # glibc's mmap threshold was still rising (large blocks mapped apart), so the
            # next forward, whose blocks land in the heap, would not reuse its free pages.
            return_freed_memory()
        if self.gatherer:
            self.gatherer.prefetch_first()
        return applied

    def _end_update(self) -> None:
        """After the update: every parameter write stored, the gradients dropped."""
        if self.param_store is not None:
            self.param_store.flush()
        self.reducer.zero()

    def _end_deferred_update(self) -> None:
        """The end of an update that ran under the forward (``overlap_step``)."""
        self._end_update()
        self.record.update_ended(self.stepper.updater.last_timings)
        return_freed_memory()  # what the update freed, before backward takes fresh blocks

    def finish_step(self) -> None:
        """Wait until the last step's update, running under the next forward with
        ``overlap_step``, has ended (every other engine method waits for it first too)."""
        self._check_open()

    def zero_grad(self) -> None:
        """Drop accumulated gradients (``step`` already does this after an update)."""
        self._check_open()
        self.coordinator.drop_early()
        self.reducer.zero()
        self.coordinator.cleared()

    # -- checkpoints (zero_offload.checkpoint; imported on use, it sits above the engine) ----
    def save_checkpoint(
        self, directory: str | os.PathLike, tag: str | None = None, lr_scheduler: Any = None
    ) -> "os.PathLike":
        """Save this rank's shards (and, rank 0, the manifest) under ``directory/tag``
        (default tag ``step<N>``); ``latest`` moves only once it is complete. Collective.
        Refused with gradients accumulated and not yet stepped (a checkpoint does not carry
        them): save at an accumulation boundary, after ``step()``."""
        self._check_open()
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

        return save_checkpoint(self, directory, tag, lr_scheduler or self.lr_scheduler)

    def load_checkpoint(
        self,
        directory: str | os.PathLike,
        tag: str | None = None,
        lr_scheduler: Any = None,
        convert_state: bool = False,
    ) -> str:
        """Resume from ``directory/tag`` (default: ``latest``), saved by any world size and
        stage; returns the tag. Collective. ``convert_state``: accept optimizer state saved
        with another kind or precision, converted through fp32 (else a CheckpointError)."""
        self._check_open()
        from ..checkpoint import load_checkpoint

        return load_checkpoint(
            self, directory, tag, lr_scheduler or self.lr_scheduler, convert_state
        )

    # -- inspection -------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full-precision parameters (every name, tied ones too) and persistent buffers (what
        ``model.load_state_dict`` takes; rank 0's buffers), on the CPU, gathered from all
        ranks' shards: the fp32 masters, and for frozen parameters their compute-dtype values.
        Collective: every rank must call it. Device memory: one unit at a time."""
        self._check_open()
        return export.full_state_dict(self)

    def frozen_shard(self, unit: FlatUnit) -> torch.Tensor:
        """This rank's shard of a frozen unit in fp32 on the CPU. Frozen parameters keep no
        fp32 master: their values are the compute-dtype parameters (exact in fp32; in
        bf16/fp16, what training used)."""
        return export.frozen_shard(self, unit)

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds per tier and kind, counted from the tensors it holds."""
        self._check_open()
        return export.memory_report(self)


def initialize(
    model: nn.Module, config: Mapping[str, Any] | str | os.PathLike | None = None, **kwargs: Any
) -> Engine:
    """Wrap ``model`` for ZeRO training. Keywords (or the same keys in ``config``, a dict or a
    JSON file path) are listed by :func:`zero_offload.config.config_keys` and documented in
    ``docs/keywords.md``; a bad one raises :class:`zero_offload.ConfigError`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize needs a torch.nn.Module, got {type(model).__name__}")
    return Engine(model, build_config(config, **kwargs))
