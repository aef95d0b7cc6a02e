"""Host tensors, page-locked exactly when they cross PCIe.

Why not ``torch.empty(pin_memory=True)``: that goes through torch's caching host allocator,
which rounds every request up to a power of two and keeps the blocks after the tensors are
gone, so a rank pins up to twice what it holds, for the life of the process. Pinning is only
worth its cost for memory that copies to or from an accelerator: a pageable source makes an
asynchronous copy synchronous. Host memory that never crosses (fp32 host gradients, the fp32
master of a low-precision model) stays pageable.

:func:`host_empty` is the one place that decides. A pinned tensor is our own anonymous mapping,
registered with ``cudaHostRegister`` at its size rounded to a 4 KiB page, and unregistered by
:func:`unpin` (owners call it at ``close()``) or, at the latest, right before the mapping is
unmapped — when the last tensor viewing it is freed (``torch.frombuffer`` holds a reference to
the mapping object, so the memory lives exactly as long as its views).
"""

from __future__ import annotations

import ctypes
import logging
import mmap

import torch

from .buffers import ALIGNMENT, round_up

__all__ = ["pins", "host_empty", "pinned_nbytes", "unpin"]

log = logging.getLogger(__name__)

_ATTR = "_zo_pinned_mapping"  # on the tensor host_empty returns: the mapping it views


class _PinnedMapping(mmap.mmap):
    """An anonymous mapping that unregisters itself before it goes."""

    nbytes = 0  # registered bytes; 0 once unregistered (or never registered)

    def pin(self, nbytes: int) -> bool:
        probe = ctypes.c_char.from_buffer(self)
        self.ptr = ctypes.addressof(probe)
        del probe  # no buffer export may outlive this call
        err = torch.cuda.cudart().cudaHostRegister(self.ptr, nbytes, 0)
        code = int(getattr(err, "value", err))
        if code != 0:
            log.warning(
                "cudaHostRegister of %d bytes failed (cudaError %d); the tensor stays "
                "pageable and its copies synchronous",
                nbytes,
                code,
            )
            return False
        self.nbytes = nbytes
        return True

    def unpin(self) -> None:
        if self.nbytes:
            self.nbytes = 0
            torch.cuda.cudart().cudaHostUnregister(self.ptr)

    def __del__(self) -> None:
        self.unpin()


def pins(crosses_pcie: bool) -> bool:
    """Whether host memory that ``crosses_pcie`` (is a source or target of host<->accelerator
    copies) is page-locked: exactly then, when CUDA is available. Pools of
    :class:`~.buffers.HostBuffer` take it as their ``pin``."""
    return crosses_pcie and torch.cuda.is_available()


def host_empty(numel: int, dtype: torch.dtype, *, crosses_pcie: bool) -> torch.Tensor:
    """A flat host tensor of ``numel`` elements, page-locked at its exact size (4 KiB pages)
    when :func:`pins` says so, instead of through torch's caching host allocator."""
    if not pins(crosses_pcie) or numel == 0:
        return torch.empty(numel, dtype=dtype)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    size = round_up(nbytes, ALIGNMENT)
    mapping = _PinnedMapping(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(mapping, dtype=dtype, count=numel)
    if mapping.pin(size):
        setattr(tensor, _ATTR, mapping)
    return tensor


def pinned_nbytes(tensor: torch.Tensor | None) -> int:
    """Bytes page-locked for ``tensor`` (a tensor from :func:`host_empty`; 0 for any other)."""
    mapping = getattr(tensor, _ATTR, None)
    return mapping.nbytes if mapping is not None else 0


def unpin(tensor: torch.Tensor | None) -> None:
    """Unregister ``tensor``'s page lock now (idempotent). The memory stays valid, pageable,
    until its last view is freed."""
    mapping = getattr(tensor, _ATTR, None)
    if mapping is not None:
        mapping.unpin()
