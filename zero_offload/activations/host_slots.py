"""Host buffers for offloaded activations, reused from one forward to the next.

A forward offloads the same sequence of tensors step after step, so the k-th tensor offloaded
since nothing was held takes the k-th buffer, grown when a tensor does not fit: a steady run
allocates (and, with CUDA, page-locks) its buffers in the first step and never again. Their
sum is bounded by the activations' share of the rank's host budget
(:func:`zero_offload.swap.budget.activation_host_share`); a tensor that would pass it is not
given a buffer and stays on the device.

Each buffer remembers the last copy that touched it (the device-to-host copy of the forward,
the host-to-device copy of the backward): it is not written again, nor freed, before that copy
is done.
"""

from __future__ import annotations

from typing import Any

import torch

from ..swap.buffers import ALIGNMENT, round_up
from ..swap.pinned import pinned_nbytes, unpin

__all__ = ["HostSlots", "slot_bytes"]

_COARSE = 2 << 20  # buffers past 2 MiB grow in 2 MiB steps: a slightly longer batch fits


def slot_bytes(nbytes: int) -> int:
    """Host bytes of the buffer an offloaded storage of ``nbytes`` takes (what the planner adds
    up for the tensors a forward offloads)."""
    return round_up(nbytes, _COARSE if nbytes > _COARSE else ALIGNMENT)


class HostSlots:
    """The buffers, in the order a pass takes them. ``host_empty(numel, dtype)``: where a
    buffer comes from (page-locked with CUDA: :meth:`Streams.host_empty`); ``limit``: the
    most bytes all buffers may hold together."""

    def __init__(self, host_empty: Any, limit: int) -> None:
        self._host_empty = host_empty
        self.limit = int(limit)
        self.buffers: list[torch.Tensor] = []  # uint8
        self._busy: list[Any] = []  # per buffer: the last copy that touched it, or None
        self._next = 0  # the buffer the next offload takes
        self.held = 0  # buffers holding a tensor now
        self.capacity = 0  # bytes of all buffers

    def take(self, nbytes: int) -> int | None:
        """The index of a buffer of at least ``nbytes`` for the next offloaded tensor, or None
        when the limit leaves no room for it."""
        k = self._next
        need = slot_bytes(nbytes)
        if k < len(self.buffers) and self.buffers[k].numel() >= nbytes:
            self._wait(k)
        else:
            old = self.buffers[k].numel() if k < len(self.buffers) else 0
            if self.capacity - old + need > self.limit:
                return None
            if k < len(self.buffers):  # too small: replaced once its last copy is done
                self._wait(k)
                unpin(self.buffers[k])
                self.buffers[k] = self._host_empty(need, torch.uint8)
            else:
                self.buffers.append(self._host_empty(need, torch.uint8))
                self._busy.append(None)
            self.capacity += need - old
        self._next += 1
        self.held += 1
        return k

    def view(self, k: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """Buffer ``k``'s first ``nbytes`` as a flat tensor of ``dtype``."""
        return self.buffers[k][:nbytes].view(dtype)

    def touched(self, k: int, event: Any) -> None:
        """A copy into or out of buffer ``k`` was issued; done when ``event`` fires."""
        if event is not None:
            self._busy[k] = event

    def give_back(self, k: int) -> bool:
        """Buffer ``k`` holds nothing any more; True when no buffer does (the next tensor
        offloaded takes buffer 0 again)."""
        self.held -= 1
        if self.held == 0:
            self._next = 0
            return True
        return False

    def _wait(self, k: int) -> None:
        event = self._busy[k]
        if event is not None:
            event.synchronize()
            self._busy[k] = None

    @property
    def pinned_bytes(self) -> int:
        return sum(pinned_nbytes(b) for b in self.buffers)

    def close(self) -> None:
        """Wait for the copies in flight, then unpin every buffer."""
        for k in range(len(self.buffers)):
            self._wait(k)
            unpin(self.buffers[k])
