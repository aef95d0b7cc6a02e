"""Progress of long operations: building a large model, loading its weights, saving, loading
and consolidating checkpoints; and the benchmarks' status line.

Run interactively (stderr is a terminal) with tqdm installed, a progress bar; otherwise (a
batch job, a log file) a log line at each tenth of the work, so that a job log shows how far
a 20-minute load got without a bar's carriage returns. tqdm is optional: without it the log
lines are shown everywhere.
"""

from __future__ import annotations

import importlib
import logging
import sys
from types import TracebackType
from typing import Any

__all__ = ["Progress", "clear_status", "show_status"]

log = logging.getLogger(__name__)


def _on_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return callable(isatty) and bool(isatty())


def show_status(msg: str) -> None:
    """What a benchmark is running now: one updating line on a terminal, and a plain line each
    otherwise, so that a log reads line by line."""
    if _on_terminal():
        print(f"\r\033[K{msg}", end="", file=sys.stderr, flush=True)
    else:
        print(msg, file=sys.stderr, flush=True)


def clear_status() -> None:
    """Erase the status line before the report (a log keeps its lines)."""
    if _on_terminal():
        print("\r\033[K", end="", file=sys.stderr, flush=True)


def _bar(what: str, total: float, unit: str) -> Any:
    """A tqdm bar when stderr is a terminal and tqdm is installed, else None."""
    if not _on_terminal():
        return None
    try:
        tqdm = importlib.import_module("tqdm.auto").tqdm  # optional: no hard dependency
    except ImportError:
        return None
    scale = unit == "B"
    return tqdm(
        total=total,
        desc=what,
        unit=unit,
        unit_scale=scale,
        unit_divisor=1024,
        leave=False,
        dynamic_ncols=True,
    )


class Progress:
    """``update(n)`` as ``n`` more of ``total`` is done; ``close()`` (or leave the ``with``)
    at the end. ``show=False`` (e.g. on ranks other than 0) shows nothing. ``logger``: whose
    name the log lines carry (the operation's module)."""

    def __init__(
        self,
        what: str,
        total: float,
        unit: str = "",
        *,
        show: bool = True,
        logger: logging.Logger | None = None,
    ) -> None:
        self.what = what
        self.total = max(float(total), 0.0)
        self.unit = unit
        self.done = 0.0
        self._show = show and self.total > 0
        self._logger = logger or log
        self._bar = _bar(what, self.total, unit) if self._show else None
        self._next_tenth = 1

    def update(self, n: float = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        if not self._show:
            return
        tenth = min(10, int(10 * self.done / self.total))
        if tenth >= self._next_tenth:
            self._next_tenth = tenth + 1
            self._logger.info(
                "%s: %d%% (%s of %s%s)",
                self.what,
                10 * tenth,
                _amount(self.done, self.unit),
                _amount(self.total, self.unit),
                "" if self.unit == "B" or not self.unit else f" {self.unit}",
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _amount(value: float, unit: str) -> str:
    if unit != "B":
        return f"{value:g}"
    for name, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if value >= size:
            return f"{value / size:.1f} {name}"
    return f"{value:g} B"
