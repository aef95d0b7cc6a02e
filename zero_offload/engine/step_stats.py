"""What the last optimizer step did: ``engine.last_step``.

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
from typing import Any, Iterator

from torch.profiler import record_function

__all__ = ["StepClock", "StepRecord", "optimizer_stats", "summarize"]


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


class StepRecord:
    """What the last step did (``engine.last_step``, ``last_comm``, ``last_step_peak``) and
    the clock of the window the next step ends; at each step's end it takes the parts'
    counts and starts them again."""

    def __init__(self) -> None:
        self.clock = StepClock()
        self.last: dict[str, float] = {}
        self.comm: dict = {}  # the collectives' counters of the last step
        self.peak = 0  # stage 3: peak gathered param bytes of the last step

    def step_ended(self, engine: Any, applied: bool) -> None:
        self.last = summarize(engine, applied, engine.stepper.updater.last_timings)
        self.clock.reset()
        self.comm = engine.comm.stats()
        engine.comm.reset_stats()
        engine.unit_states.reset_counts()
        engine.reducer.reset_counts()
        if engine.gatherer:
            self.peak = engine.gatherer.peak_gathered_bytes
            engine.gatherer.reset_peak()
        if engine.activations is not None:
            engine.activations.reset_peak()

    def update_ended(self, timings: Any) -> None:
        """The update that ran under the forward ended: its timings replace the last's."""
        self.last.update(optimizer_stats(timings))


def summarize(engine: Any, applied: bool, timings: Any) -> dict[str, float]:
    """The flat, loggable stats of the step that just ended (numbers only), with the
    optimizer's ``timings``. With the update running under the next forward (``overlap_step``)
    those are the update's before, until :func:`optimizer_stats` of this one replaces them."""
    clock: StepClock = engine.record.clock
    out: dict[str, float] = {
        "forward_s": clock.seconds.get("forward", 0.0),
        "backward_s": clock.seconds.get("backward", 0.0),
        "step_s": clock.seconds.get("step", 0.0),
        **optimizer_stats(timings),
        "applied": float(applied),
        "loss_scale": float(engine.loss_scale),
        "skipped_steps": float(engine.skipped_steps),
    }
    out.update(engine.reducer.counts())
    norm = engine.last_grad_norm
    if norm is not None:
        out["grad_norm"] = float(norm)
    if engine.gatherer is not None:
        out["peak_gathered_bytes"] = float(engine.gatherer.peak_gathered_bytes)
        out.update(engine.unit_states.counts())
    if engine.activations is not None:
        out.update(engine.activations.stats())
    for kind, s in engine.comm.stats().items():
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
