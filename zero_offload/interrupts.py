"""SIGINT and SIGTERM that arrive inside an update wait for the update's state to be whole.

Python raises a signal handler's exception (``KeyboardInterrupt`` for Ctrl-C, whatever a
scheduler's SIGTERM handler raises) wherever the main thread happens to be. Inside an NVMe
optimizer update that is the middle of a pipeline: some sub-groups stepped, others not, reads
and writes in flight. Unwinding from there leaves a state that is neither the old one nor the
new one, lost until a checkpoint is loaded again.

So the engine runs each piece of a step that changes state — ``step()`` as a whole, and each
sub-group of an update left to run under the next forward (``overlap_step``) — inside
:func:`signals_held`: a SIGINT or SIGTERM that arrives there is recorded, and raised again as
the piece ends, through the disposition it would have met (the handler that was installed,
Python's ``KeyboardInterrupt``, or the default action that ends the process). The exception
then leaves either a finished step, or an update whose remaining sub-groups still have every
input they need: the next engine call (``zero_grad()``, ``save_checkpoint``) runs them to the
end. A checkpoint saved from an ``except KeyboardInterrupt`` block therefore holds the whole
update, and resumes bit for bit. A piece lasts at most one step's update: the wait is short.

Only the main thread runs Python signal handlers and may change them; elsewhere (and in an
update run off the main thread) nothing needs holding. The per-process record below is the
one such state the library keeps, as signal dispositions are per process.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal.signal and getsignal wrap it in enums
import contextlib
import functools
import signal
import threading
from types import FrameType
from typing import Any, Callable, Iterator, ParamSpec, TypeVar

__all__ = ["HELD_SIGNALS", "holds_signals", "signals_held"]

_P = ParamSpec("_P")
_R = TypeVar("_R")

HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Held:
    """The dispositions replaced while signals are held, and what arrived meanwhile."""

    def __init__(self) -> None:
        self.depth = 0
        self.previous: dict[int, Any] = {}
        self.arrived: list[int] = []

    def record(self, signum: int, frame: FrameType | None) -> None:
        if signum not in self.arrived:
            self.arrived.append(signum)


_HELD = _Held()


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the block (nested blocks join the outer one); raise each
    that arrived as the outermost block ends."""
    held = _HELD
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if held.depth == 0:
        # The engine holds signals hundreds of times a step (each piece of bookkeeping in
        # forward and backward): the C module's calls take under 3 µs a block, signal's 21.
        for sig in HELD_SIGNALS:
            previous = _signal.getsignal(sig)
            if previous is None or previous == signal.SIG_IGN:  # not Python's, or ignored
                continue
            held.previous[sig] = previous
            _signal.signal(sig, held.record)
    held.depth += 1
    try:
        yield
    finally:
        held.depth -= 1
        if held.depth == 0:
            replaced, held.previous = held.previous, {}
            for number, disposition in replaced.items():
                if _signal.getsignal(number) == held.record:  # not if the block put its own
                    _signal.signal(number, disposition)
            arrived, held.arrived = held.arrived, []
            for signum in arrived:  # as if it arrived now: its handler runs (and may raise) here
                signal.raise_signal(signum)


def holds_signals(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``method`` inside :func:`signals_held`: for bookkeeping that changes in several
    steps (a buffer taken, a request started, its future recorded; a unit's memory swapped
    and its state set), which a KeyboardInterrupt between two of them would leave half done
    for the save and ``close()`` that follow. The main thread runs these in forward and
    backward, where no step holds signals."""

    @functools.wraps(method)
    def held(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with signals_held():
            return method(*args, **kwargs)

    return held
