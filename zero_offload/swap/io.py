"""Asynchronous direct-I/O file engine for large tensors.

A request (one buffer, one file, one offset) is split into ``block_size`` blocks; each block is
one ``os.preadv``/``os.pwritev`` run by a pool of ``queue_depth`` threads (the syscalls release
the GIL). The caller gets one ``concurrent.futures.Future`` per request, completed after every
block has finished, so a completed future never leaves a thread still touching the buffer.
Every completion is checked: a short transfer is retried once for the remainder, then fails;
an errno fails. The first error is the future's exception (:class:`SwapIOError`, naming file,
offset and cause); blocks not yet started are skipped. Waiters block on the future's
condition variable, never spin.

Files are opened with ``O_DIRECT`` so the page cache is neither polluted nor measured. Where
the filesystem refuses it (tmpfs), the engine falls back to buffered I/O followed by
``posix_fadvise(DONTNEED)`` and logs one warning.

Buffer rules (direct I/O): a contiguous CPU tensor or a C-contiguous memoryview whose address,
byte size and file offset are multiples of 4096. Pad sizes up (``buffers.round_up``); a
:class:`~zero_offload.swap.buffers.HostBuffer` always qualifies and, being huge-page backed,
lets the disk take its largest requests.

Why a thread pool: with huge-page buffers every mechanism compared (one thread of large
sequential requests, this pool, aiofiles; 4-32 MiB blocks, 4-8 in flight) reaches the disk's
ceiling, so the simplest one is kept: futures without an event loop, no C extension. aiofiles
is itself a thread pool behind an event loop, without positioned reads/writes, and adds
nothing; a C AIO/io_uring kernel is not needed. The measurements are in docs/swap_io.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Union

import numpy as np
import torch

from ..errors import SwapIOError

__all__ = [
    "IOBackend",
    "OsBackend",
    "FileIOEngine",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_QUEUE_DEPTH",
    "ALIGNMENT",
]

logger = logging.getLogger(__name__)

ALIGNMENT = 4096
DEFAULT_BLOCK_SIZE = 8 * 1024 * 1024
"""Bytes per syscall; measured (docs/swap_io.md)."""
DEFAULT_QUEUE_DEPTH = 8
"""Blocks in flight (= I/O threads); measured (docs/swap_io.md)."""

Buffer = Union[torch.Tensor, memoryview]


class IOBackend(Protocol):
    """The syscalls the engine makes; swap in a fault-injecting one for tests."""

    def open(self, path: str, flags: int) -> int: ...
    def preadv(self, fd: int, buffers: list[memoryview], offset: int) -> int: ...
    def pwritev(self, fd: int, buffers: list[memoryview], offset: int) -> int: ...
    def close(self, fd: int) -> None: ...


class OsBackend:
    """Plain ``os`` calls."""

    def open(self, path: str, flags: int) -> int:
        return os.open(path, flags, 0o600)

    def preadv(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def pwritev(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def close(self, fd: int) -> None:
        os.close(fd)


def as_byte_view(buf: Buffer, writable: bool) -> tuple[memoryview, int]:
    """Flat byte memoryview of ``buf`` and its address; raises ``ValueError`` if unusable."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"file I/O needs a CPU tensor, got device {buf.device}")
        if not buf.is_contiguous():
            raise ValueError("file I/O needs a contiguous tensor")
        flat = buf.detach().reshape(-1).view(torch.uint8)
        return flat.numpy().data, flat.data_ptr()
    if isinstance(buf, memoryview):
        if not buf.c_contiguous:
            raise ValueError("file I/O needs a C-contiguous memoryview")
        if writable and buf.readonly:
            raise ValueError("read() needs a writable buffer")
        mv = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        addr = np.frombuffer(mv, dtype=np.uint8).ctypes.data if mv.nbytes else 0
        return mv, addr
    raise TypeError(f"buffer must be a torch.Tensor or memoryview, got {type(buf).__name__}")


@dataclass
class _Request:
    """One read/write: its blocks complete in any order; the last one settles the future."""

    op: str
    path: str
    fd: int
    offset: int
    nbytes: int
    view: memoryview
    owner: object  # keeps the caller's tensor alive while threads use its memory
    buffered: bool
    remaining: int
    future: Future = field(default_factory=Future)
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class FileIOEngine:
    """Thread-pool direct I/O with futures. See the module docstring for the rules.

    ``block_size``: bytes per syscall (multiple of 4096). ``queue_depth``: blocks in flight.
    ``backend``: syscall provider (default :class:`OsBackend`).
    """

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        backend: IOBackend | None = None,
    ) -> None:
        if block_size <= 0 or block_size % ALIGNMENT:
            raise ValueError(
                f"block_size must be a positive multiple of {ALIGNMENT}, got {block_size}"
            )
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        self.block_size = int(block_size)
        self.queue_depth = int(queue_depth)
        self.backend: IOBackend = backend if backend is not None else OsBackend()
        self._pool = ThreadPoolExecutor(max_workers=self.queue_depth, thread_name_prefix="zo-io")
        self._direct_refused: set[int] = set()  # st_dev of filesystems that refused O_DIRECT
        self._state_lock = threading.Lock()
        self._closed = False

    # ---- public API -------------------------------------------------------------------
    def write(self, path: str | Path, buf: Buffer, offset: int = 0) -> "Future[None]":
        """Write all of ``buf`` to ``path`` at ``offset`` (file created if missing)."""
        return self._submit("write", path, buf, offset)

    def read(self, path: str | Path, buf: Buffer, offset: int = 0) -> "Future[None]":
        """Fill all of ``buf`` from ``path`` at ``offset``, or fail (short file = error)."""
        return self._submit("read", path, buf, offset)

    async def write_async(self, path: str | Path, buf: Buffer, offset: int = 0) -> None:
        await asyncio.wrap_future(self.write(path, buf, offset))

    async def read_async(self, path: str | Path, buf: Buffer, offset: int = 0) -> None:
        await asyncio.wrap_future(self.read(path, buf, offset))

    def close(self) -> None:
        """Finish every submitted request, then stop the threads. Requests made from now on,
        or racing this call, fail with :class:`SwapIOError` (their files are closed)."""
        with self._state_lock:
            self._closed = True
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "FileIOEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------
    def _submit(self, op: str, path: str | Path, buf: Buffer, offset: int) -> "Future[None]":
        path = os.fspath(path)
        view, addr = as_byte_view(buf, writable=(op == "read"))
        nbytes = view.nbytes
        if offset < 0 or offset % ALIGNMENT or nbytes % ALIGNMENT or addr % ALIGNMENT:
            raise ValueError(
                f"{op} of {path}: direct I/O needs address, size and offset aligned to {ALIGNMENT} "
                f"(address {addr:#x}, size {nbytes}, offset {offset}); pad the size with "
                "buffers.round_up and use a HostBuffer or an aligned tensor"
            )
        if self._closed:  # refused before opening anything; checked again under the lock below
            raise self._closed_error(op, path, offset, nbytes)
        fut: Future[None] = Future()
        fut.set_running_or_notify_cancel()
        if nbytes == 0:
            fut.set_result(None)
            return fut
        try:
            fd, buffered = self._open(path, op)
        except OSError as exc:
            fut.set_exception(SwapIOError.from_oserror(exc, path, offset, nbytes, f"open for {op}"))
            return fut
        nblocks = -(-nbytes // self.block_size)
        req = _Request(op, path, fd, offset, nbytes, view, buf, buffered, nblocks, fut)
        with self._state_lock:  # close() cannot slip between the check and the submits
            if self._closed:
                self.backend.close(fd)
                raise self._closed_error(op, path, offset, nbytes)
            for start in range(0, nbytes, self.block_size):
                self._pool.submit(self._run_block, req, start, min(start + self.block_size, nbytes))
        return fut

    @staticmethod
    def _closed_error(op: str, path: str, offset: int, nbytes: int) -> SwapIOError:
        return SwapIOError(
            path,
            f"{op} refused: the FileIOEngine is closed (use a new engine)",
            offset=offset,
            nbytes=nbytes,
        )

    def _open(self, path: str, op: str) -> tuple[int, bool]:
        flags = os.O_RDONLY if op == "read" else os.O_WRONLY | os.O_CREAT
        flags |= getattr(os, "O_CLOEXEC", 0)
        direct = getattr(os, "O_DIRECT", 0)
        parent_dev = self._device_of(path)
        if direct and parent_dev not in self._direct_refused:
            try:
                return self.backend.open(path, flags | direct), False
            except OSError as exc:
                if exc.errno != 22:  # EINVAL: this filesystem has no O_DIRECT
                    raise
                with self._state_lock:
                    first = parent_dev not in self._direct_refused
                    self._direct_refused.add(parent_dev)
                if first:
                    logger.warning(
                        "O_DIRECT refused on the filesystem of %s; using buffered I/O with "
                        "posix_fadvise(DONTNEED) there (page cache may be used)",
                        path,
                    )
        return self.backend.open(path, flags), True

    @staticmethod
    def _device_of(path: str) -> int:
        try:
            return os.stat(os.path.dirname(os.path.abspath(path)) or ".").st_dev
        except OSError:
            return -1

    def _run_block(self, req: _Request, start: int, end: int) -> None:
        error: BaseException | None = None
        if req.error is None:  # skip blocks queued behind a failure
            try:
                self._transfer(req, start, end)
            except SwapIOError as exc:
                error = exc
            except OSError as exc:
                error = SwapIOError.from_oserror(
                    exc, req.path, req.offset + start, end - start, req.op
                )
            except BaseException as exc:  # noqa: BLE001 - must settle the future whatever happens
                error = exc
        with req.lock:
            if error is not None and req.error is None:
                req.error = error
            req.remaining -= 1
            last = req.remaining == 0
        if last:
            self._finish(req)

    def _transfer(self, req: _Request, start: int, end: int) -> None:
        call = self.backend.preadv if req.op == "read" else self.backend.pwritev
        want = end - start
        done = call(req.fd, [req.view[start:end]], req.offset + start)
        if done < want:  # short transfer: retry the remainder once
            pos = start + max(done, 0)
            more = call(req.fd, [req.view[pos:end]], req.offset + pos)
            done = max(done, 0) + max(more, 0)
            if done < want:
                raise SwapIOError(
                    req.path,
                    f"short {req.op}: {done} of {want} bytes after one retry"
                    + (" (file ends early)" if req.op == "read" else ""),
                    offset=req.offset + start,
                    nbytes=want,
                )

    def _finish(self, req: _Request) -> None:
        try:
            if req.buffered:
                try:
                    os.posix_fadvise(req.fd, req.offset, req.nbytes, os.POSIX_FADV_DONTNEED)
                except (OSError, AttributeError):
                    pass
            self.backend.close(req.fd)
        except OSError as exc:
            if req.error is None:
                req.error = SwapIOError.from_oserror(exc, req.path, req.offset, req.nbytes, "close")
        req.view = memoryview(b"")
        req.owner = None
        if req.error is not None:
            req.future.set_exception(req.error)
        else:
            req.future.set_result(None)
