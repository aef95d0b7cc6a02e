"""Where a training step is, in one place: the engine's phase and the window the optimizer
update runs in, every change checked against one table.

    IDLE ──forward──> FORWARD ──closes──> (back)     LENDING: gathered_parameters(), from
      │                                               IDLE, REDUCED or FORWARD, and back
      └──backward──> BACKWARD ──ends──> REDUCED ──forward / backward──> ...
                         │                 │
      final backward: UPDATING(EARLY)      ├──zero_grad()──> IDLE
      a thread steps sub-groups as         └──step()──> STEP ──boundary──> IDLE
      their gradients land                                 └──between boundaries──> REDUCED
                                          in STEP: the update runs
      UPDATING(EARLY) ──adopted──> UPDATING(AT_STEP)        (ends in step())
                      ──adopted──> UPDATING(UNDER_FORWARD)  (ends under the next forward,
                      ──dropped──> none                      or at any other engine call)

The active phases (FORWARD, BACKWARD, STEP, LENDING) nest on top of the resting one (IDLE:
no gradients since the last update, REDUCED: some), since a trainer's step function may call
backward and step inside its forward window (``engine.forward_window()``); leaving a phase
returns to the one below. An update is in at most one window at a time. A change the table
does not list is a defect of the library: it raises a ``RuntimeError`` naming both ends.

The update under the next forward (``overlap_step``): with the optimizer state on NVMe a step
is disk-bound, every sub-group read, updated and written back. Nothing in the next forward
needs a parameter before its own module runs, so ``step()`` only agrees on the gradients
(flags, overflow, norm) and starts the update; the sub-groups are then stepped as the next
forward asks for its units' shards (in rank-flat order, which is the order the modules were
registered in: for a transformer stack, the order its forward runs them), and the disk reads
and writes of the next sub-groups run while the forward computes. Each sub-group runs exactly
the computation of the sequential step, so the results are equal bit for bit. A
:class:`DeferredUpdate` wraps the updater's per-sub-group iteration; the coordinator holds it,
the :class:`~.stepper.ShardStepper` runs it through a unit before the unit's shard is read,
and the engine runs it to the end before anything else reads or changes the training state
(in every method but the forward).
"""

from __future__ import annotations

import contextlib
import enum
import logging
from typing import Callable, Generator, Iterator

from ..interrupts import signals_held
from .nvme.early import EarlyUpdate

__all__ = [
    "Phase",
    "UpdateWindow",
    "WindowCoordinator",
    "DeferredUpdate",
    "ENTERED_FROM",
    "UPDATE_MOVES",
]

log = logging.getLogger(__name__)


def _illegal(what: str) -> RuntimeError:
    return RuntimeError(f"zero_offload internal error: {what} (a defect: please report it)")


class Phase(enum.Enum):
    """What the engine is doing."""

    IDLE = "idle"  # resting: no gradients since the last update
    REDUCED = "reduced"  # resting: gradients accumulated, waiting for step() or more
    FORWARD = "forward"  # a forward window is open
    BACKWARD = "backward"  # engine.backward() runs
    STEP = "step"  # engine.step() runs: flags, norm, then the update
    LENDING = "lending"  # gathered_parameters(): forwards read lent values, open no window


class UpdateWindow(enum.Enum):
    """Where the optimizer update runs (``WindowCoordinator.update`` None: no update in flight)."""

    EARLY = "during the final backward"  # step_during_backward, until step() adopts it
    AT_STEP = "at step()"
    UNDER_FORWARD = "under the next forward"  # overlap_step


RESTING = frozenset({Phase.IDLE, Phase.REDUCED})

ENTERED_FROM: dict[Phase, frozenset[Phase]] = {
    # an explicit window inside lending; a root forward recomputed by checkpointing
    Phase.FORWARD: RESTING | {Phase.LENDING, Phase.BACKWARD},
    # a trainer's manual backward or step inside its forward window
    Phase.BACKWARD: RESTING | {Phase.FORWARD, Phase.LENDING},
    Phase.STEP: RESTING | {Phase.FORWARD, Phase.LENDING},
    Phase.LENDING: RESTING | {Phase.FORWARD, Phase.LENDING},
}
"""Active phase -> the phases (the one on top) it may be entered from."""

_ANY = frozenset(Phase)
UPDATE_MOVES: dict[tuple[UpdateWindow | None, UpdateWindow | None], frozenset[Phase]] = {
    (None, UpdateWindow.EARLY): frozenset({Phase.BACKWARD}),
    (UpdateWindow.EARLY, None): _ANY,  # dropped (zero_grad, another backward, close ...)
    (UpdateWindow.EARLY, UpdateWindow.AT_STEP): frozenset({Phase.STEP}),
    (UpdateWindow.EARLY, UpdateWindow.UNDER_FORWARD): frozenset({Phase.STEP}),
    (None, UpdateWindow.AT_STEP): frozenset({Phase.STEP}),
    (None, UpdateWindow.UNDER_FORWARD): frozenset({Phase.STEP}),
    (UpdateWindow.AT_STEP, None): frozenset({Phase.STEP}),
    (UpdateWindow.UNDER_FORWARD, None): _ANY,  # finished, or abandoned at close
}
"""(update window before, after) -> the phases the change may happen in."""


class DeferredUpdate:
    """An update stepped sub-group by sub-group on demand. ``steps`` yields, after each
    sub-group, the rank-flat end of the elements whose new values are stored; ``on_done``
    runs once every sub-group is (the engine's end of a step: flush the parameter writes,
    drop the gradients); ``on_error`` runs if a sub-group fails, before the error goes on."""

    def __init__(
        self,
        steps: Generator[int, None, None],
        on_done: Callable[[], None],
        on_error: Callable[[], None],
    ) -> None:
        self._steps = steps
        self._on_done = on_done
        self._on_error = on_error
        self.stored = 0  # rank-flat elements [0, stored) hold their new values
        self.done = False

    def run_through(self, end: int) -> None:
        """Step sub-groups until rank-flat elements [0, end) hold their new values."""
        while not self.done and self.stored < end:
            self._advance()

    def finish(self) -> None:
        """Step every remaining sub-group and wait until all is stored (a Ctrl-C meanwhile
        waits for the end: whoever asked for the whole update gets it)."""
        with signals_held():
            while not self.done:
                self._advance()

    def _advance(self) -> None:
        """One sub-group, whole: a signal arriving meanwhile is raised after it
        (:mod:`zero_offload.interrupts`), and the sub-groups left stay to be run."""
        with signals_held():
            self._step_one()

    def _step_one(self) -> None:
        try:
            self.stored = next(self._steps)
        except StopIteration:
            self.done = True
            self._on_done()
        except BaseException:
            self.done = True
            self._on_error()
            raise

    def abandon(self) -> None:
        """Stop without finishing (the engine closes while an exception propagates): the
        updater waits for its requests in flight and marks a partly updated state."""
        if self.done:
            return
        self.done = True
        try:
            self._steps.close()
        except Exception as err:  # noqa: BLE001 - the engine is going away; say what was lost
            log.warning("closing with an overlapped optimizer step unfinished: %s", err)
        finally:
            self._on_error()


class WindowCoordinator:
    """One engine's phase and update window, and the handles of an update in flight: the
    pass during backward (:attr:`early`) and the update left under the forward
    (:attr:`pending`). The engine, the stepper and the updaters ask it where the step is
    and tell it what begins and ends; none keeps a flag of its own for it."""

    def __init__(self) -> None:
        self._resting = Phase.IDLE
        self._active: list[Phase] = []
        self.update: UpdateWindow | None = None
        self.early: EarlyUpdate | None = None
        self.pending: DeferredUpdate | None = None
        self.boundaries = 0  # step() calls that ended an accumulation window
        self._watchers: list[Callable[[Phase, UpdateWindow | None], None]] = []

    @property
    def phase(self) -> Phase:
        return self._active[-1] if self._active else self._resting

    @property
    def lending(self) -> bool:
        """Inside ``gathered_parameters()``: the model's forwards open no window."""
        return Phase.LENDING in self._active

    def watch(self, fn: Callable[[Phase, UpdateWindow | None], None]) -> None:
        """Call ``fn(phase, update)`` after every change (tests and tracing)."""
        self._watchers.append(fn)

    def _changed(self) -> None:
        for fn in self._watchers:
            fn(self.phase, self.update)

    # -- phases -------------------------------------------------------------------------
    def enter(self, phase: Phase) -> None:
        if self.phase not in ENTERED_FROM.get(phase, frozenset()):
            raise _illegal(f"engine phase {phase.name} entered from {self.phase.name}")
        self._active.append(phase)
        self._changed()

    def leave(self, phase: Phase) -> None:
        if self.phase is not phase:
            raise _illegal(f"engine phase {phase.name} left while in {self.phase.name}")
        self._active.pop()
        if phase is Phase.BACKWARD:
            self._resting = Phase.REDUCED
        self._changed()

    @contextlib.contextmanager
    def during(self, phase: Phase) -> Iterator[None]:
        self.enter(phase)
        try:
            yield
        finally:
            self.leave(phase)

    def cleared(self) -> None:
        """The gradients are gone (applied by a step at a boundary, or dropped)."""
        if Phase.BACKWARD in self._active:
            raise _illegal("gradients dropped while a backward runs")
        if Phase.STEP in self._active:
            self.boundaries += 1
        self._resting = Phase.IDLE
        self._changed()

    # -- the update's window ------------------------------------------------------------
    def _move(self, to: UpdateWindow | None) -> None:
        if self.phase not in UPDATE_MOVES.get((self.update, to), frozenset()):
            before = self.update.name if self.update else "none"
            raise _illegal(
                f"optimizer update moved from {before} to {to.name if to else 'none'} "
                f"in phase {self.phase.name}"
            )
        self.update = to
        self._changed()

    def start_early(self, early: EarlyUpdate) -> None:
        """The final backward's pass began."""
        self._move(UpdateWindow.EARLY)
        self.early = early

    def drop_early(self) -> None:
        """Stop the pass and drop what it wrote (its gradients went, or were never final)."""
        early, self.early = self.early, None
        if early is not None:
            self._move(None)
            early.drop()

    def begin_update(self, where: UpdateWindow) -> EarlyUpdate | None:
        """The step's update begins ``where``; returns the pass it adopts (the updater
        adopts its sub-groups or drops it from here on), if one runs."""
        early, self.early = self.early, None
        self._move(where)
        return early

    def end_update(self) -> None:
        """The update at step() ended (or failed)."""
        self._move(None)

    def defer(self, pending: DeferredUpdate) -> None:
        """The update begun ``UNDER_FORWARD`` is left to run as the next forward reads."""
        self.pending = pending

    def pending_ran(self) -> None:
        """The update under the forward ran some sub-groups: forget it once it is done."""
        if self.pending is not None and self.pending.done:
            self.pending = None
            self._move(None)

    def settle(self) -> None:
        """Run an update left under the forward to its end."""
        pending = self.pending
        if pending is None:
            return
        try:
            pending.finish()
        finally:
            self.pending_ran()

    def abandon(self) -> None:
        """Drop an update still pending (closing while an exception propagates), and the
        pass of a backward that no step adopted."""
        self.drop_early()
        pending, self.pending = self.pending, None
        if pending is not None:
            try:
                pending.abandon()
            finally:
                self._move(None)
