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

    ``on_widen``: a host shard that may start in the compute dtype (see
    :func:`~.host.host_grad_dtype`); the first piece summed into a region that holds
    one already makes the shard fp32 (exact: the first pieces are the reduced values as they
    are), so every sum is taken in fp32, and ``on_widen`` gets the new tensor."""

    def __init__(
        self, grads: torch.Tensor, on_widen: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        self.grads = grads
        self.on_widen = on_widen
        # offsets of the pieces summed or handed out by :meth:`region` since the last zero_grad
        self._filled: set[int] = set()
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
        self._filled.add(offset)
        add_into(self.grads[offset : offset + values.numel()], values.to(self.grads.device))

    def region(self, offset: int, like: torch.Tensor) -> torch.Tensor | None:
        """The zeroed region at ``offset`` with ``like``'s size, dtype and device, for a
        caller to overwrite with reduced gradients in place (no temporary buffer, no add);
        None when a piece was summed or handed out there since :meth:`zero_grad`, or it
        differs from ``like`` (then :meth:`accumulate_grad`, which sums the next piece
        into what the caller wrote)."""
        view = self.grads[offset : offset + like.numel()]
        if offset in self._filled or view.dtype != like.dtype or view.device != like.device:
            return None
        self._filled.add(offset)
        return view

    def alias(self, offset: int, like: torch.Tensor) -> torch.Tensor | None:
        """The region at ``offset`` with ``like``'s size, for good: stage 0's params take
        their views of it as ``.grad``, so autograd sums into the shard in place. None when
        the shard may be replaced (``on_widen``) or differs from ``like`` in dtype or
        device."""
        view = self.grads[offset : offset + like.numel()]
        if self.on_widen is not None or view.dtype != like.dtype or view.device != like.device:
            return None
        return view

    def zero_grad(self) -> None:
        self.grads.zero_()
        self._filled.clear()

    def flush(self) -> None:
        pass  # summed at once
