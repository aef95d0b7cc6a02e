"""A released unit's storage pointed at memory that already holds its values, instead of a
fresh allocation filled by a copy.

On one rank a stage-3 unit's shard is the whole unit: the host slice that keeps it, or the
pool buffer an NVMe read filled, holds exactly what a gather would copy into ``unit.full``.
Every view of ``full`` (the module's parameters, tensors autograd saved) shares its storage
object, not its memory, which is why a released unit can be re-filled under them; here the
storage object is given the shard's memory for as long as the unit is gathered, and its own
empty allocation back when it is released. The memory stays referenced (a closed store
cannot free it under a view), and nothing is copied or faulted in.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["SharedStorage", "can_share"]


def can_share(full: torch.Tensor, shard: torch.Tensor) -> bool:
    """Whether ``shard`` (host memory holding all of ``full``'s values, in its dtype) can be
    ``full``'s storage while gathered."""
    return bool(
        hasattr(torch.UntypedStorage, "_swap_data_ptr_")  # recent torch; else gathers copy
        and full.device.type == "cpu"
        and shard.device.type == "cpu"
        and not is_fake(shard)
        and shard.dtype == full.dtype
        and shard.is_contiguous()
        and shard.numel() == full.numel()
        and full.storage_offset() == 0
        and full.untyped_storage().nbytes() == 0
    )


class SharedStorage:
    """``full``'s (empty) storage holding ``shard``'s memory until :meth:`end`."""

    __slots__ = ("_storage", "_swapped")

    def __init__(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        # A storage over the shard's bytes that keeps the shard's own alive (through the
        # array that exposes them), so that the memory outlives whoever lent it.
        held = torch.frombuffer(shard.detach().view(torch.uint8).numpy(), dtype=torch.uint8)
        self._storage = held.untyped_storage()
        self._swapped = full.untyped_storage()
        self._swapped._swap_data_ptr_(self._storage)  # type: ignore[attr-defined]

    def end(self) -> None:
        """Give the storage its empty allocation back (the shard's memory is the lender's
        again)."""
        self._swapped._swap_data_ptr_(self._storage)  # type: ignore[attr-defined]
        self._storage = self._swapped = None  # type: ignore[assignment]
