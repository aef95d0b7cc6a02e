"""The training loop's backward and step (:class:`StepDriver`), and what the last optimizer
step did: ``engine.last_step``.

When a step is slow the first question is where the time went (forward, backward, the
optimizer step, and inside it the disk and the CPU Adam). :class:`StepClock` times the engine's
phases over one accumulation window, each inside a ``torch.profiler.record_function`` range so
that a user's profiler trace shows them, and :func:`summarize` adds the optimizer's own
timings, the gradient norm, the loss scale and what the collectives moved. Trainer
integrations log the result through the trainer's loggers.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.profiler import record_function

from ..comm import Comm
from ..config import ZeroConfig
from ..swap.budget import return_freed_memory
from ..update.window import Phase
from ..weak import weak_hook

if TYPE_CHECKING:
    from .build import Parts
    from .lifecycle import Lifecycle

__all__ = ["StepClock", "StepDriver", "StepRecord", "optimizer_stats", "summarize"]


class StepClock:
    """Seconds spent per phase since the last :meth:`reset`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with record_function(f"zero_offload.{name}"):
                yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def reset(self) -> None:
        self.seconds.clear()


class StepDriver:
    """The training loop over the engine's shared ``parts``: backward, the step that counts a
    micro-step and at the accumulation boundary reduces, updates and records what it did
    (counted in ``record``), and the end of each update. ``lifecycle`` refuses a closed
    engine; ``lr_scheduler`` is stepped after each applied update."""

    def __init__(
        self,
        config: ZeroConfig,
        comm: Comm,
        parts: Parts,
        lifecycle: Lifecycle,
        record: StepRecord,
        lr_scheduler: Any,
    ) -> None:
        self._config = config
        self._comm = comm
        self._parts = parts
        self._lifecycle = lifecycle
        self._record = record
        self.lr_scheduler = lr_scheduler

    @property
    def is_accumulation_boundary(self) -> bool:
        return (self._record.micro_steps + 1) % self._config.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, final: bool | None) -> None:
        """See :meth:`zero_offload.Engine.backward`."""
        self._lifecycle.check_open()
        if loss.numel() != 1:
            raise ValueError(f"backward needs a scalar loss, got shape {tuple(loss.shape)}")
        with self._parts.coordinator.during(Phase.BACKWARD):
            self._backward(loss, self.is_accumulation_boundary if final is None else final)

    def _backward(self, loss: torch.Tensor, final: bool) -> None:
        parts = self._parts
        scale = parts.stepper.loss_scale / self._config.gradient_accumulation_steps
        parts.reducer.begin_backward(final=final)
        parts.stepper.begin_backward(final)
        parts.reducer.on_landed = parts.stepper.landing()
        if parts.gatherer:
            parts.gatherer.begin_backward()
        if parts.activations is not None:
            parts.activations.begin_backward()
        if final:
            # Freed heap pages go back now, while the heap is at its fullest: the pages the
            # activations hold stay resident for the next forward to reuse, where returning
            # them after the step would have that forward fault each of them in again.
            return_freed_memory()
        try:
            with self._record.clock.phase("backward"):
                (loss * scale if scale != 1.0 else loss).backward()
                parts.reducer.end_backward()
        except BaseException:
            parts.coordinator.drop_early()
            raise
        finally:
            if parts.gatherer:
                parts.gatherer.end_backward()

    def step(self) -> bool:
        """See :meth:`zero_offload.Engine.step` (without the preemption check)."""
        self._lifecycle.check_open()
        boundary = self.is_accumulation_boundary
        if boundary:
            self._lifecycle.check_parameters()
        self._record.micro_steps += 1
        coordinator = self._parts.coordinator
        with coordinator.during(Phase.STEP):
            if not boundary:
                coordinator.drop_early()  # a backward passed final=True off the boundary
                return False
            return self._update()

    def _update(self) -> bool:
        """The step at a boundary: reduce, update, record what it did."""
        parts, coordinator = self._parts, self._parts.coordinator
        with self._record.clock.phase("step"):
            flags = parts.reducer.reduce_accumulated()
            applied = parts.stepper.step(
                flags, parts.reducer.reduce_late, defer=weak_hook(self._end_deferred_update)
            )
            if coordinator.pending is None:
                self._end_update()
        coordinator.cleared()
        if applied:
            self._record.global_steps += 1
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self._record.step_ended(parts, self._comm, applied)
        if coordinator.boundaries == 1:
            # Once: the first step laid its blocks out while glibc's mmap threshold was still
            # rising (large blocks mapped apart), so the next forward, whose blocks land in
            # the heap, would not reuse its free pages. Not at every step: the pages the
            # backward freed are the ones the next forward's activations take again (each
            # given back is faulted in again; see _backward).
            return_freed_memory()
        if parts.gatherer:
            parts.gatherer.prefetch_first()
        return applied

    def _end_update(self) -> None:
        """After the update: every parameter write stored, the gradients dropped."""
        if self._parts.param_store is not None:
            self._parts.param_store.flush()
        self._parts.reducer.zero()

    def _end_deferred_update(self) -> None:
        """The end of an update that ran under the forward (``overlap_step``)."""
        self._end_update()
        self._record.update_ended(self._parts.stepper.updater.last_timings)
        return_freed_memory()  # what the update freed, before backward takes fresh blocks

    def zero_grad(self) -> None:
        """See :meth:`zero_offload.Engine.zero_grad`."""
        self._lifecycle.check_open()
        coordinator = self._parts.coordinator
        coordinator.drop_early()
        self._parts.reducer.zero()
        coordinator.cleared()
        # the window's gradients are gone: its micro-batches count again from its first one
        self._record.micro_steps -= (
            self._record.micro_steps % self._config.gradient_accumulation_steps
        )


class StepRecord:
    """What the last step did (``engine.last_step``, ``last_comm``, ``last_step_peak``), the
    steps counted so far and the clock of the window the next step ends; at each step's end
    it takes the parts' counts and starts them again."""

    def __init__(self) -> None:
        self.micro_steps = 0  # step() calls
        self.global_steps = 0  # updates applied
        self.clock = StepClock()
        self.last: dict[str, float] = {}
        self.comm: dict = {}  # the collectives' counters of the last step
        self.peak = 0  # stage 3: peak gathered param bytes of the last step

    def step_ended(self, parts: Parts, comm: Comm, applied: bool) -> None:
        self.last = summarize(self, parts, comm, applied, parts.stepper.updater.last_timings)
        self.clock.reset()
        self.comm = comm.stats()
        comm.reset_stats()
        parts.unit_states.reset_counts()
        parts.reducer.reset_counts()
        if parts.gatherer:
            self.peak = parts.gatherer.peak_gathered_bytes
            parts.gatherer.reset_peak()
        if parts.activations is not None:
            parts.activations.reset_peak()

    def update_ended(self, timings: Any) -> None:
        """The update that ran under the forward ended: its timings replace the last's."""
        self.last.update(optimizer_stats(timings))


def summarize(
    record: StepRecord, parts: Parts, comm: Comm, applied: bool, timings: Any
) -> dict[str, float]:
    """The flat, loggable stats of the step that just ended (numbers only), with the
    optimizer's ``timings``. With the update running under the next forward (``overlap_step``)
    those are the update's before, until :func:`optimizer_stats` of this one replaces them."""
    clock = record.clock
    stepper = parts.stepper
    out: dict[str, float] = {
        "forward_s": clock.seconds.get("forward", 0.0),
        "backward_s": clock.seconds.get("backward", 0.0),
        "step_s": clock.seconds.get("step", 0.0),
        **optimizer_stats(timings),
        "applied": float(applied),
        "loss_scale": float(stepper.loss_scale),
        "skipped_steps": float(stepper.scaler.skipped_steps if stepper.scaler else 0),
    }
    out.update(parts.reducer.counts())
    norm = stepper.last_grad_norm
    if norm is not None:
        out["grad_norm"] = float(norm)
    if parts.gatherer is not None:
        out["peak_gathered_bytes"] = float(parts.gatherer.peak_gathered_bytes)
        out.update(parts.unit_states.counts())
    if parts.activations is not None:
        out.update(parts.activations.stats())
    for kind, s in comm.stats().items():
        out[f"{kind}_bytes"] = float(s.bytes)
        out[f"{kind}_calls"] = float(s.calls)
    return out


def optimizer_stats(t: Any) -> dict[str, float]:
    """The optimizer update's fields of :func:`summarize`, from its ``StepTimings``."""
    out = {
        "adam_s": t.compute_s,  # the optimizer's arithmetic (CPU Adam when offloaded)
        "optimizer_wall_s": t.wall_s,
    }
    if t.bytes_read or t.bytes_written:  # the optimizer state is on NVMe
        out["nvme_read_s"] = t.read_s
        out["nvme_write_s"] = t.write_s
        out["nvme_wait_s"] = max(0.0, t.wall_s - t.compute_s)  # the step not hidden by Adam
        if t.io_busy_s > 0:
            out["disk_gbps"] = (t.bytes_read + t.bytes_written) / t.io_busy_s / 1e9
        out["early_groups"] = t.early_groups  # sub-groups stepped during the backward
    return out
