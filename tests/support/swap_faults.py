"""Fault injection for the swap tests: a backend that fails chosen syscalls."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from zero_offload.swap.io import OsBackend


class FaultBackend(OsBackend):
    """OsBackend that fails the chosen call: raise ``errno`` or transfer ``short`` bytes."""

    def __init__(
        self,
        op: str,
        *,
        errno_: int | None = None,
        short: int | None = None,
        times: int = 10**9,
        after: int = 0,
        refuse_direct: bool = False,
    ) -> None:
        self.op, self.errno_, self.short, self.times, self.after = op, errno_, short, times, after
        self.refuse_direct = refuse_direct
        self.calls = 0

    def open(self, path: str, flags: int) -> int:
        if self.refuse_direct and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return super().open(path, flags)

    def _maybe_fail(self, op: str, fd: int, buffers: list[memoryview], offset: int, real) -> int:
        if op == self.op:
            self.calls += 1
            if self.after < self.calls <= self.after + self.times:
                if self.errno_ is not None:
                    raise OSError(self.errno_, os.strerror(self.errno_))
                if self.short is not None:
                    return real(fd, [buffers[0][: self.short]], offset) if self.short else 0
        return real(fd, buffers, offset)

    def preadv(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        return self._maybe_fail("read", fd, buffers, offset, os.preadv)

    def pwritev(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        return self._maybe_fail("write", fd, buffers, offset, os.pwritev)


@contextlib.contextmanager
def mounted_tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A small real filesystem (tmpfs with ``options``) at ``where``; skips the test when this
    container refuses the mount."""
    where.mkdir(exist_ok=True)
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True
    )
    if res.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs ({options}) here: {res.stderr.strip() or res.returncode}"
        )
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
