"""Aligned host buffers and a fixed pool of them with back-pressure.

Why this shape:
- O_DIRECT needs 4096-aligned addresses and sizes, and the disk takes at most ~254 segments
  per request, so physically contiguous (huge-page backed) buffers let it take its largest
  requests (docs/swap_io.md measures both kinds of buffer).
  Each buffer is an anonymous mmap, 2 MiB aligned, ``madvise(MADV_HUGEPAGE)`` (THP in
  ``madvise`` mode is enough).
- Touching fresh memory faults it in page by page (docs/swap_io.md, "Host buffers", has the
  cost), so buffers are touched once at creation (``MADV_POPULATE_WRITE`` when the kernel has
  it) and reused: the pool is fixed.
- With CUDA the buffers are page-locked with ``cudaHostRegister`` so host<->device copies are
  asynchronous DMA.
- Closing never unmaps memory a tensor still points to: ``torch.frombuffer`` holds a reference
  to the mmap object (not a buffer export, so ``mmap.close()`` would succeed and leave views
  dangling). Close drops the buffer's own references instead; the mapping goes when the last
  view does.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import mmap
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import BufferBudgetError
from .budget import host_memory_budget
from .disk import current_disk

__all__ = [
    "advise_huge_pages",
    "ALIGNMENT",
    "HUGE_PAGE",
    "HostBuffer",
    "BufferPool",
    "BufferBudgetError",
    "pool_count",
    "pool_footprint",
    "round_up",
]

logger = logging.getLogger(__name__)

ALIGNMENT = 4096
"""Address, offset and size granularity of direct I/O."""
HUGE_PAGE = 2 * 1024 * 1024
"""Transparent huge page size on x86-64 / most arm64 kernels."""
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not exported by the mmap module


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def _footprint(nbytes: int, huge_pages: bool) -> int:
    """Bytes a buffer may hold resident: a huge page is allocated whole."""
    return round_up(nbytes, HUGE_PAGE if huge_pages else ALIGNMENT)


def pool_footprint(buffer_bytes: int) -> int:
    """Host bytes one :class:`BufferPool` buffer of ``buffer_bytes`` takes (huge pages from
    2 MiB up, whole huge pages then), for callers that size buffers to a budget."""
    nbytes = round_up(int(buffer_bytes), ALIGNMENT)
    return _footprint(nbytes, nbytes >= HUGE_PAGE)


def pool_count(footprint: int, needed: int, host_memory_limit: int) -> int:
    """Buffers of ``footprint`` bytes a pool that wants ``needed`` gets under
    ``host_memory_limit``: as many as fit, at most ``needed`` (the pool refuses to run on fewer
    than its minimum)."""
    return min(needed, int(host_memory_limit) // footprint)


def _advise(mm: mmap.mmap, advice: int, offset: int, length: int) -> bool:
    try:
        mm.madvise(advice, offset, length)
        return True
    except (OSError, ValueError):
        return False


@functools.lru_cache(maxsize=1)
def _libc_madvise() -> Any:
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):  # not a libc with madvise
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask the kernel to back the whole 2 MiB pages inside a fresh host tensor with huge
    pages, before anything writes it; True if it took the advice.

    For memory the allocator hands out anew every pass (a gathered stage-3 unit): 2 MiB pages
    fault in several times faster than 4 KiB ones (docs/host_memory.md, "Gathered units in
    huge pages"). The advice stays with the addresses: glibc unmaps a block from 32 MiB when
    it is freed; a smaller one goes back to the heap, whose freed pages
    :func:`~.budget.return_freed_memory` returns."""
    nbytes = tensor.untyped_storage().nbytes()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    madvise = _libc_madvise() if nbytes >= 2 * HUGE_PAGE and advice is not None else None
    if madvise is None or tensor.device.type != "cpu":
        return False
    start = round_up(tensor.untyped_storage().data_ptr(), HUGE_PAGE)
    end = (tensor.untyped_storage().data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    return end > start and madvise(start, end - start, advice) == 0


class HostBuffer:
    """One aligned host buffer, exposed as a flat ``torch.uint8`` tensor.

    ``nbytes`` is the requested size rounded up to 4096 (direct I/O granularity); the tensor
    has exactly ``nbytes`` elements and its ``data_ptr()`` is 2 MiB aligned.
    """

    def __init__(self, nbytes: int, *, huge_pages: bool = True, pin: bool | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"HostBuffer nbytes must be positive, got {nbytes}")
        self.nbytes = round_up(int(nbytes), ALIGNMENT)
        self.footprint = _footprint(self.nbytes, huge_pages)
        mm = mmap.mmap(-1, self.footprint + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._mmap: mmap.mmap | None = mm  # None once closed
        probe = ctypes.c_char.from_buffer(mm)
        base = ctypes.addressof(probe)
        del probe  # release the buffer export so the mmap can be closed later
        offset = (-base) % HUGE_PAGE
        self.huge_pages = huge_pages and _advise(mm, mmap.MADV_HUGEPAGE, offset, self.footprint)
        if not self.huge_pages and huge_pages:
            self.footprint = _footprint(self.nbytes, False)
        self._tensor: torch.Tensor | None = torch.frombuffer(
            mm, dtype=torch.uint8, count=self.nbytes, offset=offset
        )
        if not _advise(mm, _MADV_POPULATE_WRITE, offset, self.nbytes):
            self.tensor[::ALIGNMENT].zero_()  # one write per 4 KiB page faults it in
        self.pinned = False
        if pin is None:
            pin = torch.cuda.is_available()
        if pin:
            self._pin()

    def _pin(self) -> None:
        """Page-lock for asynchronous host<->device copies (CUDA only)."""
        err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
        code = int(getattr(err, "value", err))
        if code != 0:
            logger.warning(
                "cudaHostRegister of %d bytes failed (cudaError %d); buffer stays pageable",
                self.nbytes,
                code,
            )
        else:
            self.pinned = True

    @property
    def tensor(self) -> torch.Tensor:
        """The whole buffer as a flat ``uint8`` tensor; ``RuntimeError`` once closed."""
        if self._tensor is None:
            raise RuntimeError(
                "HostBuffer is closed; views taken before close() stay valid, new ones "
                "need a buffer from an open pool"
            )
        return self._tensor

    @property
    def closed(self) -> bool:
        return self._tensor is None

    @property
    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def view(self, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """A typed view of the buffer's first bytes (no copy)."""
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.nbytes:
            raise ValueError(
                f"view of {nbytes} bytes does not fit a HostBuffer of {self.nbytes} bytes"
            )
        return self.tensor[:nbytes].view(dtype).view(shape)

    def close(self) -> None:
        """Unpin and drop this buffer's references to its memory. The mapping is unmapped when
        the last tensor viewing it is freed (at once if there is none), never under a view."""
        if self._tensor is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())
            self.pinned = False
        self._tensor = None
        self._mmap = None


class BufferPool:
    """A fixed set of equal-size :class:`HostBuffer` s; ``acquire`` blocks while all are out.

    Count = ``min(needed, host_memory_limit // footprint)``; fewer than ``minimum`` raises
    :class:`BufferBudgetError`. ``host_memory_limit`` defaults to the rank's whole host budget
    (:func:`~zero_offload.swap.budget.host_memory_budget`); the engine passes each pool its
    share.
    """

    def __init__(
        self,
        buffer_bytes: int,
        needed: int,
        *,
        minimum: int = 1,
        host_memory_limit: int | None = None,
        huge_pages: bool = True,
        pin: bool | None = None,
    ) -> None:
        if buffer_bytes <= 0:
            raise ValueError(f"buffer_bytes must be positive, got {buffer_bytes}")
        if minimum < 1 or needed < minimum:
            raise ValueError(f"need 1 <= minimum <= needed, got minimum={minimum}, needed={needed}")
        if host_memory_limit is None:
            host_memory_limit = host_memory_budget()
        self.buffer_bytes = round_up(int(buffer_bytes), ALIGNMENT)
        # A buffer smaller than a huge page gains nothing from one and would waste the rest.
        huge_pages = huge_pages and self.buffer_bytes >= HUGE_PAGE
        footprint = _footprint(self.buffer_bytes, huge_pages)
        self.host_memory_limit = int(host_memory_limit)
        count = pool_count(footprint, needed, self.host_memory_limit)
        if count < minimum:
            raise BufferBudgetError(self.host_memory_limit, footprint, minimum)
        if count < needed:
            logger.info(
                "BufferPool: host_memory_limit=%d holds %d of %d buffers wanted",
                host_memory_limit,
                count,
                needed,
            )
        disk = current_disk()  # a rehearsal's simulated disk gives buffers without memory
        make = HostBuffer if disk is None else disk.host_buffer
        self._buffers = [
            make(self.buffer_bytes, huge_pages=huge_pages, pin=pin) for _ in range(count)
        ]
        self._ids = {id(b) for b in self._buffers}
        self._free: deque[HostBuffer] = deque(self._buffers)
        self._cond = threading.Condition()
        self._closed = False

    @property
    def count(self) -> int:
        return len(self._buffers)

    @property
    def nbytes(self) -> int:
        """Host bytes this pool holds (for the memory ledger), huge-page rounding included."""
        return sum(b.footprint for b in self._buffers)

    @property
    def pinned_nbytes(self) -> int:
        """Bytes of this pool page-locked with ``cudaHostRegister`` (for the memory ledger)."""
        return sum(b.nbytes for b in self._buffers if b.pinned)

    @property
    def available(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, timeout: float | None = None) -> HostBuffer:
        """Take a free buffer, waiting (without spinning) until one is released.

        Raises ``TimeoutError`` after ``timeout`` seconds, ``RuntimeError`` if the pool is closed.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._free or self._closed, timeout):
                raise TimeoutError(
                    f"no host buffer free after {timeout} s (pool of {self.count} x "
                    f"{self.buffer_bytes} bytes); "
                    "release buffers sooner or raise host_memory_limit"
                )
            if self._closed:
                raise RuntimeError("BufferPool is closed")
            return self._free.popleft()

    def release(self, buf: HostBuffer) -> None:
        """Give a buffer back and wake one waiter. After :meth:`close` this does nothing (by
        design: a holder finishing late, e.g. in a ``finally``, must not fail or revive the
        buffer); a buffer of another pool is still a ``ValueError``."""
        with self._cond:
            if id(buf) not in self._ids:
                raise ValueError("release() of a buffer that does not belong to this pool")
            if self._closed:
                return
            if any(b is buf for b in self._free):
                raise ValueError("release() of a buffer that is already free")
            self._free.append(buf)
            self._cond.notify()

    @contextlib.contextmanager
    def borrow(self, timeout: float | None = None) -> Iterator[HostBuffer]:
        """``with pool.borrow() as buf:`` acquire and always release."""
        buf = self.acquire(timeout)
        try:
            yield buf
        finally:
            self.release(buf)

    def close(self) -> None:
        """Close every buffer (see :meth:`HostBuffer.close`: memory still viewed stays mapped
        until its views go); waiters and later ``acquire`` calls get ``RuntimeError``."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        for b in self._buffers:
            b.close()
        self._free.clear()

    def __enter__(self) -> "BufferPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
