"""The sub-group pipeline both NVMe updaters step through, and what a failed step leaves.

A step reads the next sub-group in files while sub-group k is stepped in its host buffer and
the one before is written back, so the disk and the CPU work at the same time. The sub-groups
kept in host memory (``offload_optimizer_fraction``, spread between the others by
:func:`~.sizing.host_placement`) are stepped while the next read from disk is in flight: they
hide its time rather than add to it. With fewer than three pool buffers there is no room to
read ahead, and each sub-group is read after the one before is written.

What a sub-group is (fp32 [master | m | v], or a state policy's arrays) is the updater's: it
says how one is read, stepped, given back and dropped (:class:`SubGroups`). The pipeline owns
the order, the write-backs and whether the files are sound. A step is all or nothing from the
caller's view: one that fails before any sub-group changed leaves the state as it was (a retry
runs the same update); one that fails after that drops the files and every later step or
state read raises :class:`IncompleteStepError` until the whole state is loaded again.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any, Generator, Protocol

from ...errors import IncompleteStepError
from ..api import StepTimings
from .io_clock import IoClock

__all__ = ["SubGroupPipeline", "SubGroups"]

log = logging.getLogger(__name__)

Reads = tuple["Future | None", ...]
"""A sub-group's reads in flight (None: that part is in host memory already)."""


class SubGroups(Protocol):
    """What the pipeline asks of an updater about its sub-group ``i``."""

    def read_group(self, i: int, timings: StepTimings) -> Reads:
        """Start reading what sub-group ``i``'s step needs from files."""
        ...

    def step_group(self, i: int, got: list[Any], timings: StepTimings) -> Future | None:
        """Step sub-group ``i`` on what its reads gave (in their order, None for a part in
        host memory), telling the pipeline (:meth:`SubGroupPipeline.changing`) before its
        state changes; the write-back in flight, or None where nothing is written."""
        ...

    def release_group(self, i: int) -> None:
        """Give sub-group ``i``'s buffers back once its step and write-back are done."""
        ...

    def drop_group(self, i: int, changed: bool) -> None:
        """After a failed step: give sub-group ``i``'s buffers back, and delete its files
        too where the step ``changed`` the state (they no longer hold one state)."""
        ...


class SubGroupPipeline:
    """Steps an updater's sub-groups ``bounds`` in order, those marked ``on_host`` in host
    memory, and keeps which sub-groups a failed step left undefined."""

    def __init__(self, bounds: list[tuple[int, int]], on_host: tuple[bool, ...]) -> None:
        assert len(on_host) == len(bounds)
        self.bounds = bounds
        self.on_host = on_host
        self.io_clock = IoClock()  # times the disk requests of the step that runs
        self.stale: set[int] = set()  # sub-groups whose files a failed step left undefined
        self.stale_cause = ""
        self.changed: list[int] = []  # sub-groups the running step has changed

    # -- soundness ------------------------------------------------------------------------
    @property
    def sound(self) -> bool:
        return not self.stale

    def ensure_sound(self, what: str) -> None:
        """Raise :class:`IncompleteStepError` when an earlier step left the state partly
        updated."""
        if self.stale:
            raise IncompleteStepError(
                f"cannot {what}: an earlier optimizer step failed halfway ({self.stale_cause})"
                f" and left the NVMe optimizer state partly updated; restore a saved state "
                f"first with engine.load_checkpoint(...) (or engine.optimizer.load_state_dict)"
            )

    def loaded(self, i: int) -> None:
        """Sub-group ``i``'s whole state was stored again."""
        self.stale.discard(i)

    def changing(self, i: int) -> None:
        """Sub-group ``i``'s state is about to change: a failure from here on is partial."""
        self.changed.append(i)

    # -- the step -------------------------------------------------------------------------
    def run(self, groups: SubGroups, lookahead: bool) -> Generator[int, None, StepTimings]:
        """Read, step and write back every sub-group; each yields the rank-flat end of the
        sub-groups stepped so far. Returns the step's timings once all are on disk.
        ``lookahead``: the pools have room to read a sub-group ahead."""
        self.changed = []
        timings, start = StepTimings(), time.perf_counter()
        try:
            yield from self._walk(groups, lookahead, timings)
        except BaseException as exc:
            self._abort(groups, exc)
            raise
        timings.wall_s = time.perf_counter() - start
        return timings

    def _walk(
        self, groups: SubGroups, lookahead: bool, timings: StepTimings
    ) -> Generator[int, None, None]:
        in_files = [i for i, host in enumerate(self.on_host) if not host]
        after = dict(zip(in_files, in_files[1:]))  # the next sub-group in files
        pending = groups.read_group(in_files[0], timings) if in_files else None
        writes: dict[int, Future] = {}  # sub-group -> its write-back
        stepped: int | None = None  # the sub-group in files stepped last, buffers still held

        def release(j: int) -> None:
            """Give sub-group j's buffers back once its write-back is done; a failed one
            fails the step now, before the pipeline runs short of buffers it keeps."""
            write = writes.get(j)
            if write is not None:
                write.result()
            groups.release_group(j)

        for i, (_, hi) in enumerate(self.bounds):
            if self.on_host[i]:  # only its gradients may be in files
                groups.step_group(i, _results(groups.read_group(i, timings)), timings)
                groups.release_group(i)
                yield hi
                continue
            assert pending is not None
            got = _results(pending)
            nxt = after.get(i)
            if lookahead and nxt is not None:
                pending = groups.read_group(nxt, timings)
            write = groups.step_group(i, got, timings)
            if write is not None:
                writes[i] = write
            if stepped is not None:
                release(stepped)
            stepped = i
            if not lookahead and nxt is not None:
                release(i)
                stepped = None
                pending = groups.read_group(nxt, timings)
            yield hi
        if stepped is not None:
            release(stepped)
        self.io_clock.wait_idle()  # completion callbacks may still be running
        for write in writes.values():
            write.result()  # a failed write-back fails the step

    def _abort(self, groups: SubGroups, exc: BaseException) -> None:
        """After a failed step: wait for the requests still in flight and give the buffers
        back. Nothing changed: the state is as before. Otherwise its files are dropped and
        the optimizer refuses to run until the state is loaded again."""
        changed, total = len(self.changed), len(self.bounds)
        if changed:
            self.stale = set(range(total))
            self.stale_cause = (
                "the engine closed while it ran under the forward"
                if isinstance(exc, GeneratorExit)
                else f"{type(exc).__name__}: {exc}"
            )
        self.io_clock.wait_idle()
        for i in range(total):
            try:
                groups.drop_group(i, bool(changed))
            except OSError as err:  # the disk may be gone; the state is marked already
                log.warning("cleaning up after the failed step: %s", err)
        if not changed:
            log.warning(
                "optimizer step failed before any state changed (%s); the state is "
                "as before the step",
                exc,
            )
        elif isinstance(exc, GeneratorExit):  # no caller to raise to: the engine closes
            log.warning(
                "an optimizer update running under the forward was dropped after %d of %d "
                "sub-groups (the engine closed during an exception)",
                changed,
                total,
            )
        elif not isinstance(exc, Exception):  # Ctrl-C, an exit: it goes on as it is
            log.warning(
                "optimizer step interrupted (%s) after updating %d of %d NVMe sub-groups; "
                "the partly updated state must be loaded again",
                type(exc).__name__,
                changed,
                total,
            )
        else:
            log.error(
                "optimizer step failed after updating %d of %d sub-groups (%s); the state "
                "must be loaded again",
                changed,
                total,
                self.stale_cause,
            )
            raise IncompleteStepError(
                f"the optimizer step failed after updating {changed} of {total} NVMe "
                f"sub-groups ({self.stale_cause}); the partly updated state was dropped. "
                "Restore a saved state with engine.load_checkpoint(...) (or "
                "engine.optimizer.load_state_dict) before stepping again"
            ) from exc


def _results(reads: Reads) -> list[Any]:
    return [None if r is None else r.result() for r in reads]
