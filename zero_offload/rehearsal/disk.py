"""The NVMe tier of a rehearsal: the engine's own swap code on a disk that keeps sizes only.

:class:`SimulatedDisk` stands in for the files (``zero_offload.swap.disk.use_disk``): a write
records how far each file now reaches, a read checks that what it asks for was written
(reading what was never written is an error, as it would be on disk), and no byte is stored.
Pool buffers are fake host tensors of their real size, counted by the tracker as host memory.
The swap folder itself is a real, empty temporary one. The live, peak, read and written
bytes are what the rehearsal reports as the NVMe tier.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from ..errors import SwapIOError
from ..swap.buffers import ALIGNMENT, HUGE_PAGE, HostBuffer, round_up

__all__ = ["SimulatedDisk"]

_UNLIMITED = 1 << 62


def _nbytes(buf: Any) -> int:
    if isinstance(buf, torch.Tensor):
        return buf.numel() * buf.element_size()
    return memoryview(buf).nbytes


class _Files:
    """One swapper's I/O engine: its files go when the swapper closes it (its folder goes)."""

    def __init__(self, disk: "SimulatedDisk") -> None:
        self.disk = disk
        self.paths: set[str] = set()

    def write(self, path: str | Path, buf: Any, offset: int = 0) -> "Future[None]":
        nbytes = _nbytes(buf)
        key = str(path)
        end = offset + nbytes
        grown = end - self.disk.sizes.get(key, 0)
        if grown > 0:
            if grown > self.disk.free_bytes(Path(key)):
                return _failed(
                    SwapIOError(key, f"the simulated disk of {self.disk.capacity} bytes is full")
                )
            self.disk.sizes[key] = end
            self.paths.add(key)
            self.disk.grow(grown)
        self.disk.written += nbytes
        return _done()

    def read(self, path: str | Path, buf: Any, offset: int = 0) -> "Future[None]":
        nbytes = _nbytes(buf)
        if self.disk.sizes.get(str(path), 0) < offset + nbytes:
            return _failed(
                SwapIOError(str(path), f"read of {nbytes} bytes at {offset} past what was written")
            )
        self.disk.read += nbytes
        return _done()

    def close(self) -> None:
        for key in self.paths:
            self.disk.remove(Path(key))
        self.paths.clear()


def _done() -> "Future[None]":
    fut: Future[None] = Future()
    fut.set_result(None)
    return fut


def _failed(exc: BaseException) -> "Future[None]":
    fut: Future[None] = Future()
    fut.set_exception(exc)
    return fut


class _FakeHostBuffer(HostBuffer):
    """A pool buffer of the real size without memory (a fake ``uint8`` host tensor): only
    the allocation differs from :class:`HostBuffer`; views, checks and close are its own."""

    def __init__(self, nbytes: int, huge_pages: bool) -> None:
        self.nbytes = round_up(int(nbytes), ALIGNMENT)
        self.footprint = round_up(self.nbytes, HUGE_PAGE if huge_pages else ALIGNMENT)
        self.huge_pages = huge_pages
        self.pinned = False
        self._mmap = None
        self._tensor = torch.empty(self.nbytes, dtype=torch.uint8)


class SimulatedDisk:
    """Files of tracked sizes and no contents; ``capacity`` bytes (None: unlimited)."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.sizes: dict[str, int] = {}  # how far each file reaches
        self.live = 0  # bytes the files hold now
        self.peak = 0  # most bytes held since reset_peak()
        self.read = 0  # bytes read and written so far
        self.written = 0

    def grow(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def reset_peak(self) -> None:
        self.peak = self.live

    # -- zero_offload.swap.disk.Disk ------------------------------------------------------
    def io_engine(self, queue_depth: int = 1) -> _Files:
        return _Files(self)  # requests complete at once: no queue

    def free_bytes(self, path: Path) -> int:
        return (_UNLIMITED if self.capacity is None else self.capacity) - self.live

    def remove(self, path: Path) -> None:
        self.grow(-self.sizes.pop(str(path), 0))

    def host_buffer(self, nbytes: int, *, huge_pages: bool, pin: bool | None) -> _FakeHostBuffer:
        return _FakeHostBuffer(nbytes, huge_pages)
