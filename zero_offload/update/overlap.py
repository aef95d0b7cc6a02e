"""The tail of an optimizer step that runs under the next forward (``overlap_step``).

With the optimizer state on NVMe a step is disk-bound: every sub-group is read, updated and
written back. Nothing in the next forward needs a parameter before its own module runs, so
``step()`` only agrees on the gradients (flags, overflow, norm) and starts the update; the
sub-groups are then stepped as the next forward asks for its units' shards (in rank-flat
order, which is the order the modules were registered in: for a transformer stack, the
order its forward runs them), and the disk reads and writes of the next sub-groups run
while the forward computes. Each sub-group runs exactly the computation of the sequential
step, so the results are equal bit for bit.

A :class:`DeferredUpdate` wraps the updater's per-sub-group iteration; the engine's
:class:`~.window.WindowCoordinator` holds it, the :class:`~.stepper.ShardStepper` runs it
through a unit before the unit's shard is read, and the engine runs it to the end before
anything else reads or changes the training state (in every method but the forward).
"""

from __future__ import annotations

import logging
from typing import Callable, Generator

from ..interrupts import signals_held

__all__ = ["DeferredUpdate"]

log = logging.getLogger(__name__)


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
