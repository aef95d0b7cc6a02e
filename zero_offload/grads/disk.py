"""The fp32 gradient shard in files, for an NVMe optimizer whose host budget cannot hold it.

Reduced pieces are summed into a sub-group's host buffer as backward produces them; a
sub-group is written out once every element of it came in (its sum of squares and
finiteness noted for clipping and overflow checks, so the step needs no extra pass over the
files), and the optimizer's step reads it back beside the state (:meth:`DiskGrads.prefetch`).
With every buffer taken by sub-groups still waiting for pieces, the oldest is written out and
read back when its next piece comes, so any arrival order fits a fixed number of buffers.

A sub-group whose sums are all exact in the compute dtype (``narrow``) — one backward's
reduced pieces, the common case — is stored in it: half the bytes written during backward
and read by the step, and nothing rounded. Summed again in the same window, it is read back
widened, and the sums are taken in fp32 as before.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import is_fake

from ..errors import SwapIOError
from ..memory.ledger import MemoryReport
from ..partition import chunks, split_range
from ..swap.buffers import HostBuffer, pool_footprint
from ..swap.io import FileIOEngine
from ..swap.pinned import pins
from ..swap.swapper import Swapper
from .slices import add_into, narrow_in_place, sum_of_squares, widen_in_place

__all__ = ["DiskGrads"]

log = logging.getLogger(__name__)


class DiskGrads:
    """A :class:`~.grads.GradTarget` that sums the gradient shard sub-group by sub-group in
    host buffers and keeps the sums in files (``grad.<i>``), one per sub-group of ``bounds``."""

    @staticmethod
    def host_bytes(group: int, buffers: int) -> int:
        """Host memory it holds, as the pool rounds it: ``buffers`` fp32 sub-groups."""
        return buffers * pool_footprint(4 * group)

    def __init__(
        self,
        path: str | Path,
        numel: int,
        group: int,
        buffers: int,
        rank: int,
        engine: FileIOEngine | None = None,
        narrow: torch.dtype | None = None,
    ) -> None:
        """``narrow``: the 2-byte compute dtype sub-groups are stored in when exact in it."""
        self.numel = numel
        self.narrow = narrow
        self.group = group
        self.bounds = chunks(numel, group)
        self.swapper = Swapper(
            path,
            buffer_bytes=4 * group,
            buffer_count=buffers,
            min_buffers=2,
            host_memory_limit=self.host_bytes(group, buffers),
            rank=rank,
            engine=engine,
            pin=pins(crosses_pcie=False),
        )  # summed on the host
        # sub-groups being summed (in buffers, oldest first), elements summed so far per
        # sub-group this backward, and what was written this window
        self._filling: dict[int, HostBuffer] = {}
        self._covered: dict[int, int] = {}
        self._written: set[int] = set()
        self._narrowed: set[int] = set()  # written, in ``narrow``
        # per sub-group written: (sum of squares, all finite) of its sum so far; each write
        # replaces its entry, so the step sees the norm of the summed gradient however many
        # backwards (and flushes) the window had
        self._stats: dict[int, tuple[float, bool]] = {}
        # a write or read of a gradient file that failed this window: the sums are
        # incomplete, and nothing may read or add to them until zero_grad()
        self._failed: BaseException | None = None

    @staticmethod
    def _key(i: int) -> str:
        return f"grad.{i}"

    @property
    def buffers(self) -> int:
        """Host buffers the pool got (the step reads ahead only with a full pipeline)."""
        return self.swapper.pool.count

    # -- backward: the GradTarget face ----------------------------------------------------
    def accumulate_grad(self, offset: int, values: torch.Tensor, final: bool) -> None:
        """Add a reduced gradient piece for rank-flat [offset, offset + n); a sub-group is
        written out (its norm and finiteness noted) once every element of it came in this
        backward. ``final`` is not needed: a backward is not always followed by a step."""
        self._check_whole()
        values = values.to("cpu")
        try:
            for i, a, b in split_range(offset, offset + values.numel(), self.group):
                lo, hi = self.bounds[i]
                add_into(self._buffer(i)[a - lo : b - lo], values[a - offset : b - offset])
                self._covered[i] = self._covered.get(i, 0) + b - a
                if self._covered[i] == hi - lo:
                    self._write(i)
        except BaseException as err:
            self._failed = err
            raise

    def flush(self) -> None:
        """Write out the sub-groups that got only some pieces since their last write (late
        pieces reduced at the step; after a whole backward every sub-group is complete)."""
        self._check_whole()
        try:
            for i in list(self._covered):
                self._write(i)
        except BaseException as err:
            self._failed = err
            raise

    def _check_whole(self) -> None:
        """Refuse to go on from sums a failed write or read left incomplete (a sub-group
        whose sum was lost would restart from zeros)."""
        if self._failed is not None:
            raise SwapIOError(
                None,
                f"this window's gradients are incomplete: a gradient file failed earlier "
                f"({self._failed}); call engine.zero_grad() and run the window's backward "
                "passes again",
            ) from self._failed

    def zero_grad(self) -> None:
        """Start a new accumulation window (the files are overwritten, not read)."""
        for buf in self._filling.values():
            self.swapper.pool.release(buf)
        self._filling.clear()
        self._covered.clear()
        self._written.clear()
        self._narrowed.clear()
        self._stats.clear()
        self._failed = None

    def stats(self) -> tuple[float, bool]:
        """(sum of squares, all finite) of the summed gradients."""
        self.flush()
        sumsq = sum(sq for sq, _ in self._stats.values())
        return sumsq, all(finite for _, finite in self._stats.values())

    def _buffer(self, i: int) -> torch.Tensor:
        """Sub-group i's gradient sum in a host buffer: zeros, or what an earlier micro-step
        (or an eviction) wrote. With every buffer taken by sub-groups still waiting for
        pieces, the oldest is written out and read back when its next piece comes."""
        lo, hi = self.bounds[i]
        if i in self._filling:
            self._filling[i] = self._filling.pop(i)  # most recently used last
            return self._filling[i].view(torch.float32, (hi - lo,))
        pool = self.swapper.pool
        while pool.available < 2 and self._filling:  # keep one spare for unaligned I/O
            self._evict(next(iter(self._filling)))
        buf = pool.acquire(timeout=self.swapper.acquire_timeout)
        grad = buf.view(torch.float32, (hi - lo,))
        try:
            if i in self._narrowed:
                assert self.narrow is not None
                self.swapper.swap_in(self._key(i), grad.view(self.narrow)[: hi - lo]).result()
                widen_in_place(grad, self.narrow)
            elif i in self._written:
                self.swapper.swap_in(self._key(i), grad).result()
            else:
                grad.zero_()
        except BaseException:
            pool.release(buf)
            raise
        self._filling[i] = buf
        return grad

    def _evict(self, i: int) -> None:
        lo, hi = self.bounds[i]
        buf = self._filling.pop(i)
        try:
            grad = buf.view(torch.float32, (hi - lo,))
            narrow = None
            if self.narrow is not None and not is_fake(grad):  # a rehearsal reads no values
                narrow = narrow_in_place(grad, self.narrow)
            self._narrowed.discard(i)
            self.swapper.swap_out(self._key(i), grad if narrow is None else narrow).result()
            self._written.add(i)
            if narrow is not None:
                self._narrowed.add(i)
        finally:
            self.swapper.pool.release(buf)

    def _write(self, i: int) -> None:
        sumsq = float(sum_of_squares(self._buffer(i)))
        self._stats[i] = (sumsq, math.isfinite(sumsq))
        del self._covered[i]
        self._evict(i)

    # -- the step -------------------------------------------------------------------------
    def prefetch(self, i: int) -> "Future[torch.Tensor]":
        """Start reading sub-group i's summed gradient into a pool buffer."""
        self._check_whole()
        return self.swapper.prefetch(self._key(i))

    def stored_bytes(self, i: int) -> int:
        """Bytes of sub-group i's file (2 a gradient when stored in ``narrow``)."""
        lo, hi = self.bounds[i]
        return (2 if i in self._narrowed else 4) * (hi - lo)

    def release(self, i: int) -> None:
        """Give back the buffer :meth:`prefetch` filled (the file stays)."""
        self.swapper.release(self._key(i))

    def add_to(self, report: MemoryReport) -> None:
        report.add("nvme", "grads", 4 * self.numel)  # room for fp32 sums
        report.add(
            "host", "grads", self.swapper.host_buffer_nbytes, pinned=self.swapper.pool.pinned_nbytes
        )

    def close(self) -> None:
        self.swapper.close()
