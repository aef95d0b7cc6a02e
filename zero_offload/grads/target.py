"""Where a rank's reduced gradient shards are summed: one tensor in memory
(:class:`ResidentGrads`), or files (:class:`~.disk.DiskGrads`), behind one face
(:class:`GradTarget`) that the reducer and the host queue write to."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Callable, Protocol

import torch

from .slices import add_into

__all__ = ["GradTarget", "ResidentGrads"]

log = logging.getLogger(__name__)


class GradTarget(Protocol):
    """Where reduced gradient shards are summed: memory (:class:`ResidentGrads`) or files
    (:class:`~.disk.DiskGrads`)."""

    def accumulate_grad(
        self, offset: int, values: torch.Tensor, final: bool
    ) -> Future[None] | None:
        """Add a reduced piece at rank-flat ``offset``. None: ``values`` is not read after
        this returns; else a future done once it is (the caller reuses it only then)."""

    def zero_grad(self) -> None: ...
    def flush(self) -> None:
        """Every piece handed over so far is summed; raise the first failure."""


class ResidentGrads:
    """The rank's gradient shard as one tensor (compute dtype on the device, or in host
    memory when the optimizer is offloaded).

    ``zero_grad`` writes nothing: the first piece a region gets in a window is copied in,
    the next ones are summed, and :meth:`flush` zeroes the regions no piece reached. So a
    window's gradients cost one write of the shard, not a zeroing pass and then a
    read-modify-write. Only where autograd sums into the shard itself (stage 0's ``.grad``
    views, :meth:`alias`) does ``zero_grad`` zero it.

    ``on_widen``: a host shard that may start in the compute dtype (see
    :func:`~.host.host_grad_dtype`); the first piece summed into a region that holds
    one already makes the shard fp32 (exact: the first pieces are the reduced values as they
    are), so every sum is taken in fp32, and ``on_widen`` gets the new tensor."""

    def __init__(
        self, grads: torch.Tensor, on_widen: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        self.grads = grads  # zeros where no piece ever lands
        self.on_widen = on_widen
        # offsets of the pieces summed or handed out by :meth:`region` since the last zero_grad
        self._filled: set[int] = set()
        # offset -> numel of every region a piece ever reached
        self._regions: dict[int, int] = {}
        self._stale = False  # regions outside _filled hold an earlier window's values
        self._aliased = False  # autograd sums into views of the shard (stage 0)
        self.added_bytes = 0  # bytes of pieces summed in (not written in place)

    def accumulate_grad(self, offset: int, values: torch.Tensor, final: bool) -> None:
        self.added_bytes += values.numel() * values.element_size()
        if (
            offset in self._filled
            and self.on_widen is not None
            and self.grads.dtype != torch.float32
        ):
            log.info(
                "gradients summed over several backwards: the host gradient shard "
                "becomes fp32 (%.1f MiB)",
                self.grads.numel() * 4 / 2**20,
            )
            self.grads = self.grads.float()
            self.on_widen(self.grads)
        dst = self.grads[offset : offset + values.numel()]
        values = values.to(self.grads.device)
        if self._stale and offset not in self._filled:
            dst.copy_(values)  # the window's first piece here: what it holds is stale
        else:
            add_into(dst, values)
        self._fill(offset, values.numel())

    def region(self, offset: int, like: torch.Tensor) -> torch.Tensor | None:
        """The region at ``offset`` with ``like``'s size, dtype and device, for a caller to
        overwrite whole with reduced gradients in place (no temporary buffer, no add); None
        when a piece was summed or handed out there since :meth:`zero_grad`, or it differs
        from ``like`` (then :meth:`accumulate_grad`, which sums the next piece into what the
        caller wrote)."""
        view = self.grads[offset : offset + like.numel()]
        if offset in self._filled or view.dtype != like.dtype or view.device != like.device:
            return None
        self._fill(offset, like.numel())
        return view

    def alias(self, offset: int, like: torch.Tensor) -> torch.Tensor | None:
        """The region at ``offset`` with ``like``'s size, for good: stage 0's params take
        their views of it as ``.grad``, so autograd sums into the shard in place (from now
        on ``zero_grad`` zeroes the shard). None when the shard may be replaced
        (``on_widen``) or differs from ``like`` in dtype or device."""
        view = self.grads[offset : offset + like.numel()]
        if self.on_widen is not None or view.dtype != like.dtype or view.device != like.device:
            return None
        self._aliased = True
        return view

    def zero_grad(self) -> None:
        self._filled.clear()
        if self._aliased:
            self.grads.zero_()
        self._stale = not self._aliased

    def flush(self) -> None:
        """Pieces are summed at once; the regions no piece reached since :meth:`zero_grad`
        are zeroed (once), so the shard reads as the window's gradients. Where every region
        got its piece (each backward reduces every unit) nothing is written."""
        if not self._stale:
            return
        for offset, numel in self._regions.items():
            if offset not in self._filled:
                self.grads[offset : offset + numel].zero_()
        self._stale = False

    def _fill(self, offset: int, numel: int) -> None:
        self._filled.add(offset)
        self._regions[offset] = max(numel, self._regions.get(offset, 0))
