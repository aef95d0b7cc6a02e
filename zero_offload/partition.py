"""Pure bookkeeping of flat, padded, sharded parameter groups.

A group of parameters is laid end to end in one flat buffer, padded so that it splits into
``num_shards`` equal shards of an aligned size; rank ``r`` owns shard ``r``. This module knows
offsets, shapes and slices — nothing about devices, processes or I/O — so it is unit-tested
without any process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Iterable, Sequence

import torch

__all__ = [
    "Slot",
    "FlatLayout",
    "Overlap",
    "build_layout",
    "bucketize",
    "chunks",
    "padded_numel",
    "split_range",
    "mismatch_message",
]

SHARD_ALIGN = (
    64  # elements: every shard (and so every rank's slice) starts 256-byte aligned in fp32
)


@dataclass(frozen=True)
class Slot:
    """Where one parameter sits in the flat buffer."""

    name: str
    shape: torch.Size
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Overlap:
    """The part of one slot that falls inside one shard."""

    slot: int  # index into FlatLayout.slots
    slot_start: int  # element range inside the parameter (flattened)
    slot_end: int
    shard_start: int  # where that range starts inside the shard

    @property
    def numel(self) -> int:
        return self.slot_end - self.slot_start


@dataclass(frozen=True)
class FlatLayout:
    slots: tuple[Slot, ...]
    numel: int  # sum of parameter sizes
    padded_numel: int  # a multiple of num_shards * SHARD_ALIGN
    num_shards: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.num_shards

    def shard_range(self, shard: int) -> tuple[int, int]:
        if not 0 <= shard < self.num_shards:
            raise IndexError(f"shard {shard} out of range for {self.num_shards} shards")
        return shard * self.shard_numel, (shard + 1) * self.shard_numel

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view into ``flat`` (which holds ``padded_numel`` elements)."""
        self._check(flat)
        return [flat[s.offset : s.end].view(s.shape) for s in self.slots]

    def flatten_into(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor | None]) -> None:
        """Copy ``tensors`` (one per slot; None means zeros) into ``flat`` and zero the padding."""
        self._check(flat)
        if len(tensors) != len(self.slots):
            raise ValueError(f"expected {len(self.slots)} tensors, got {len(tensors)}")
        for slot, t in zip(self.slots, tensors):
            dst = flat[slot.offset : slot.end]
            if t is None:
                dst.zero_()
            else:
                dst.copy_(t.reshape(-1))
        flat[self.numel :].zero_()

    def overlaps(self, shard: int) -> list[Overlap]:
        """The slot pieces inside ``shard``, in order (used to map a shard back to names)."""
        lo, hi = self.shard_range(shard)
        out = []
        for i, s in enumerate(self.slots):
            start, end = max(s.offset, lo), min(s.end, hi)
            if start < end:
                out.append(Overlap(i, start - s.offset, end - s.offset, start - lo))
        return out

    def _check(self, flat: torch.Tensor) -> None:
        if flat.dim() != 1 or flat.numel() != self.padded_numel:
            raise ValueError(
                f"flat buffer must be 1-D with {self.padded_numel} elements, got "
                f"{tuple(flat.shape)}"
            )


def build_layout(
    named_shapes: Iterable[tuple[str, torch.Size]], num_shards: int, align: int = SHARD_ALIGN
) -> FlatLayout:
    """Lay parameters end to end; pad the total to ``num_shards`` equal, ``align``-sized shards."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    slots, offset = [], 0
    for name, shape in named_shapes:
        shape = torch.Size(shape)
        slots.append(Slot(name, shape, offset, shape.numel()))
        offset += shape.numel()
    return FlatLayout(tuple(slots), offset, padded_numel(offset, num_shards, align), num_shards)


def padded_numel(numel: int, num_shards: int, align: int = SHARD_ALIGN) -> int:
    """A unit of ``numel`` elements padded to ``num_shards`` equal ``align``-sized shards
    (one such row at least): the size of its flat buffer."""
    unit = num_shards * align
    return max(unit, math.ceil(numel / unit) * unit)


def bucketize(sizes: Sequence[int], bucket_size: int) -> list[list[int]]:
    """Split indices 0..len(sizes)-1, in order, into runs of at most ``bucket_size`` elements
    (a single larger item gets a bucket of its own)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if current and total + n > bucket_size:
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        buckets.append(current)
    return buckets


def chunks(numel: int, size: int) -> list[tuple[int, int]]:
    """[0, numel) cut into [lo, hi) pieces of ``size`` elements, the last one possibly
    shorter: NVMe sub-groups, a unit's shards."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    return [(lo, min(lo + size, numel)) for lo in range(0, numel, size)]


def split_range(start: int, end: int, size: int) -> list[tuple[int, int, int]]:
    """[start, end) cut where the :func:`chunks` of ``size`` meet: (chunk index, lo, hi) for
    each piece, in order (a piece of a gradient or a state load falling across sub-groups, a
    parameter's elements across ranks' shards)."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    out = []
    while start < end:
        i = start // size
        hi = min(end, (i + 1) * size)
        out.append((i, start, hi))
        start = hi
    return out


def mismatch_message(
    source: str, missing: Collection[str], unexpected: Collection[str], shapes: Collection[str]
) -> str | None:
    """One sentence listing every tensor that does not line up between ``source`` (a file or
    checkpoint) and the model; None when all do."""
    parts = [
        f"missing from the {source}: {sorted(missing)}" if missing else "",
        f"not in the model: {sorted(unexpected)}" if unexpected else "",
        f"shape mismatches: {sorted(shapes)}" if shapes else "",
    ]
    found = [p for p in parts if p]
    return "does not match the model — " + "; ".join(found) if found else None
