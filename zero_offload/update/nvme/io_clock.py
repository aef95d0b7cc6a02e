"""Times an update's disk requests: each one's duration, and the time with any in flight."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from ..api import StepTimings

__all__ = ["IoClock"]


class IoClock:
    """Adds each timed request's duration (submit to completion) to ``timings.<kind>``, and
    the time with at least one request in flight to ``timings.io_busy_s`` (the disk's share
    of the wall time). Completions run on the swap engine's threads, hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._in_flight = 0
        self._busy_since = 0.0

    def timed(self, fut: Future, kind: str, timings: StepTimings) -> Future:
        start = time.perf_counter()
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = start
            self._in_flight += 1

        def done(_: Future) -> None:
            now = time.perf_counter()
            with self._lock:
                setattr(timings, kind, getattr(timings, kind) + now - start)
                self._in_flight -= 1
                if self._in_flight == 0:
                    timings.io_busy_s += now - self._busy_since
                    self._lock.notify_all()

        fut.add_done_callback(done)
        return fut

    def wait_idle(self) -> None:
        """Until no timed request is in flight (their completion callbacks included)."""
        with self._lock:
            self._lock.wait_for(lambda: self._in_flight == 0)
