"""Every error a user can meet, with one base class, :class:`ZeroOffloadError`.

Each also keeps the builtin base that says what kind of fault it is, so that code catching
``ValueError`` (a setting to fix), ``OSError`` (the disk) or ``RuntimeError`` (the run) keeps
working. This module imports nothing of the package: every layer raises these.

Disk errors carry what a user needs to find the fault: the file, the byte range and the cause
(an errno or a short transfer). Budget and configuration errors are ``ValueError`` subclasses
because the user caused them with a setting and can fix them by changing it.
"""

from __future__ import annotations

import errno as _errno
import os
from pathlib import Path

__all__ = [
    "ZeroOffloadError",
    "ConfigError",
    "KernelBuildError",
    "IsaUnavailable",
    "DivergentForwardError",
    "ParameterNotGatheredError",
    "IncompleteStepError",
    "CheckpointError",
    "SwapIOError",
    "SwapSpaceError",
    "BufferBudgetError",
]


class ZeroOffloadError(Exception):
    """The base of every error zero_offload raises on purpose."""


class ConfigError(ZeroOffloadError, ValueError):
    """A configuration value a user can fix; the message names the key and the fix."""


class KernelBuildError(ZeroOffloadError, RuntimeError):
    """A kernel could not be compiled or loaded; the message carries the compiler output."""


class IsaUnavailable(KernelBuildError):
    """``ZERO_OFFLOAD_ISA`` asks for an instruction set this CPU lacks."""


class DivergentForwardError(ZeroOffloadError, RuntimeError):
    """The ranks' stage-3 forwards ran different modules (raised on every rank alike)."""


class ParameterNotGatheredError(ZeroOffloadError, RuntimeError):
    """A stage-3 parameter was used outside a forward, while its values are not gathered."""


class IncompleteStepError(ZeroOffloadError, RuntimeError):
    """An optimizer step on NVMe failed halfway: the state is partly updated and unusable
    until it is loaded again (``engine.load_checkpoint``)."""


class CheckpointError(ZeroOffloadError, RuntimeError):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


class SwapIOError(ZeroOffloadError, OSError):
    """A read or write of a swap file failed, or a swap file cannot be used.

    ``cause`` is a short human string ("EIO: Input/output error", "short read: 4096 of
    8192 bytes", "never written"); ``errno`` is set when the kernel gave one.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        cause: str,
        *,
        offset: int | None = None,
        nbytes: int | None = None,
        errno: int | None = None,
    ) -> None:
        super().__init__(errno if errno is not None else 0, cause)
        self.errno = errno
        self.path = None if path is None else str(path)
        self.filename = self.path
        self.offset = offset
        self.nbytes = nbytes
        self.cause = cause

    @classmethod
    def from_oserror(
        cls,
        exc: OSError,
        path: str | os.PathLike[str],
        offset: int | None,
        nbytes: int | None,
        what: str = "I/O",
    ) -> "SwapIOError":
        """Wrap a kernel error, naming it the way a user would search for it."""
        code = exc.errno
        name = _errno.errorcode.get(code, "E?") if code is not None else "error"
        reason = exc.strerror or str(exc)
        return cls(
            path, f"{what} failed: {name}: {reason}", offset=offset, nbytes=nbytes, errno=code
        )

    def __str__(self) -> str:
        where = f"{self.path!s}" if self.path is not None else "<no file>"
        if self.offset is not None:
            where += f" at offset {self.offset}"
        if self.nbytes is not None:
            where += f" ({self.nbytes} bytes)"
        return f"{where}: {self.cause}"

    def __reduce__(self):  # keep keyword arguments through pickling (multiprocessing)
        return (
            _rebuild_swap_error,
            (type(self), self.path, self.cause, self.offset, self.nbytes, self.errno),
        )


def _rebuild_swap_error(
    cls: type,
    path: str | None,
    cause: str,
    offset: int | None,
    nbytes: int | None,
    errno: int | None,
) -> SwapIOError:
    return cls(path, cause, offset=offset, nbytes=nbytes, errno=errno)


class SwapSpaceError(SwapIOError):
    """``nvme_path`` lacks the free space for the bytes a run will store (checked up front)."""

    def __init__(self, nvme_path: str | Path, needed: int, available: int) -> None:
        cause = (
            f"not enough free space under nvme_path={str(nvme_path)!r}: needed {needed} bytes "
            f"({needed / 2**30:.2f} GiB), available {available} bytes ({available / 2**30:.2f} "
            "GiB); free space there or point nvme_path at a larger disk"
        )
        super().__init__(nvme_path, cause, nbytes=needed, errno=_errno.ENOSPC)
        self.needed = needed
        self.available = available

    def __reduce__(self):
        return (type(self), (self.path, self.needed, self.available))


class BufferBudgetError(ZeroOffloadError, ValueError):
    """``host_memory_limit`` cannot hold even the minimum number of host buffers."""

    def __init__(self, host_memory_limit: int, buffer_bytes: int, minimum: int) -> None:
        need = buffer_bytes * minimum
        super().__init__(
            f"host_memory_limit={host_memory_limit} bytes ({host_memory_limit / 2**30:.2f} GiB) "
            f"cannot hold {minimum} host buffer(s) of {buffer_bytes} bytes; set host_memory_limit "
            f">= {need} bytes ({need / 2**30:.2f} GiB) or use smaller buffers"
        )
        self.host_memory_limit = host_memory_limit
        self.buffer_bytes = buffer_bytes
        self.minimum = minimum
        self.required = need

    def __reduce__(self):
        return (type(self), (self.host_memory_limit, self.buffer_bytes, self.minimum))
