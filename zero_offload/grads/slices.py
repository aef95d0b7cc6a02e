"""Whole-shard arithmetic in slices, so that no temporary is as large as the shard.

torch materializes an operand cast to another dtype: an fp64 norm of an fp32 or bf16 shard
makes an fp64 copy of it (8 bytes a parameter), and adding a bf16 piece into fp32
gradients makes an fp32 copy of the piece. For a rank's shard that is gigabytes, fresh at
every step (page faults on the host, an out-of-memory on a device). In slices of
:data:`SLICE` elements every temporary is small, and the allocator reuses it.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["SLICE", "add_into", "narrow_in_place", "sum_of_squares", "widen_in_place"]

SLICE = 1 << 20
"""Elements per slice: an fp64 temporary of 8 MiB, below the largest size that glibc's
malloc still serves from (and returns to) its heap rather than a fresh mapping."""


def sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """The sum of the squares of ``t``'s elements, accumulated in fp64, as a 0-dim fp64
    tensor on ``t``'s device: infinite or NaN exactly when an element is (the squares of
    finite fp32 values cannot overflow an fp64 sum)."""
    if t.numel() <= SLICE or is_fake(t):  # a rehearsal's tensors hold no memory
        return torch.linalg.vector_norm(t, dtype=torch.float64).square()
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for piece in t.reshape(-1).split(SLICE):
        total += torch.linalg.vector_norm(piece, dtype=torch.float64).square()
    return total


def add_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src`` (1-D, same size), with no temporary of ``dst``'s size when the
    dtypes differ."""
    if dst.dtype == src.dtype or dst.numel() <= SLICE:
        dst.add_(src)
        return
    for d, s in zip(dst.split(SLICE), src.split(SLICE)):
        d.add_(s)


def narrow_in_place(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """When every value of the 1-D fp32 ``t`` is exact in ``dtype`` (2 bytes), rewrite them in
    ``dtype`` at the start of ``t``'s memory and return that view (half the bytes); else
    None, and ``t`` is unchanged. Forward, slice by slice: a value's new place never
    overlaps a value not yet read."""
    exact = all(torch.equal(s.to(dtype).to(s.dtype), s) for s in t.split(SLICE))
    if not exact:
        return None
    narrow = t.view(dtype)[: t.numel()]
    for a in range(0, t.numel(), SLICE):
        values = t[a : a + SLICE].to(dtype)  # read before its bytes are overwritten
        narrow[a : a + values.numel()].copy_(values)
    return narrow


def widen_in_place(t: torch.Tensor, dtype: torch.dtype) -> None:
    """The inverse of :func:`narrow_in_place`: ``t`` (1-D fp32) holds ``t.numel()`` values in
    ``dtype`` at the start of its memory; make them its fp32 values. Backward, slice by
    slice, for the same reason."""
    narrow = t.view(dtype)[: t.numel()]
    for a in reversed(range(0, t.numel(), SLICE)):
        values = narrow[a : a + SLICE].to(t.dtype)
        t[a : a + values.numel()].copy_(values)
