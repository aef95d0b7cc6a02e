"""Where the swap tier's bytes live: files on a real disk, or a disk that a rehearsal simulates.

A :class:`~.swapper.Swapper` asks the disk in effect for its I/O engine, its free space and its
host buffers. Outside :func:`use_disk` that is the real disk (``folder.FileDisk``: files through
:class:`~.io.FileIOEngine`, ``statvfs``, page-aligned :class:`~.buffers.HostBuffer` s). Inside,
the disk given there answers instead: a rehearsal runs the engine's own swap code with file
sizes tracked and no data written (``zero_offload.rehearsal``).
"""

from __future__ import annotations

import contextlib
import contextvars
from pathlib import Path
from typing import Any, Iterator, Protocol

__all__ = ["Disk", "current_disk", "use_disk"]


class Disk(Protocol):
    """What a Swapper needs from the storage under it."""

    def io_engine(self, queue_depth: int) -> Any:
        """A new engine with ``read``/``write(path, buf, offset)`` -> Future and ``close()``,
        ``queue_depth`` requests in flight."""

    def free_bytes(self, path: Path) -> int:
        """Bytes that can still be written under ``path``."""

    def remove(self, path: Path) -> None:
        """Delete a file (none there: nothing to do)."""

    def host_buffer(self, nbytes: int, *, huge_pages: bool, pin: bool | None) -> Any:
        """One pool buffer: ``nbytes``, ``footprint``, ``pinned``, ``tensor``, ``data_ptr``,
        ``view(dtype, shape)``, ``close()`` (as :class:`~.buffers.HostBuffer`)."""


_CURRENT: contextvars.ContextVar[Disk | None] = contextvars.ContextVar(
    "zero_offload_disk", default=None
)


def current_disk() -> Disk | None:
    """The disk swappers made now use: None for the real one (files, ``statvfs``, page-aligned
    host memory: ``folder.FileDisk``), unless :func:`use_disk` says otherwise."""
    return _CURRENT.get()


@contextlib.contextmanager
def use_disk(disk: Disk) -> Iterator[Disk]:
    """Swappers made inside this block use ``disk`` (for their whole life)."""
    token = _CURRENT.set(disk)
    try:
        yield disk
    finally:
        _CURRENT.reset(token)
