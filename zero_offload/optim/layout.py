"""Where each optimizer-state byte of a rank's flat shard lives.

A rank steps a run of elements laid end to end: its shard of each unit (``partition``), so a
run is pieces of parameters, possibly cut at both ends by shard boundaries, and padding. With
8-bit moments the pieces matter: quantization blocks of :data:`~.policy.BLOCK` elements start
at each parameter's first element (so states line up with bitsandbytes'), a block cut by a
shard boundary becomes two partial blocks (one per rank, each with its own absmax), and
parameters under :data:`~.policy.MIN_QUANTIZED_NUMEL` elements (and padding) keep fp32
moments, as do those the policy names in ``fp32_moments``. With any other precision every
element is alike and the layout is one segment.

A moment's storage over a run is three flat arrays, each sliced by the same element range:

- ``values``: one entry per element (fp32, bf16, or the uint8 code; a code is kept, unused,
  for unquantized elements too, so that element i of the run is entry i);
- ``absmax``: one fp32 per block (8-bit only);
- ``side``: the fp32 moments of the unquantized elements, in order (8-bit only).

A range [lo, hi) that starts and ends on block boundaries (:meth:`StateLayout.is_boundary`)
owns whole blocks, so it maps to one contiguous slice of each array (:class:`Span`): that is
how the NVMe pipeline sizes a sub-group's buffers and files, and how any range is stepped.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ..partition import FlatLayout
from .policy import BLOCK, FP32_BYTES, MIN_QUANTIZED_NUMEL, StatePolicy

__all__ = ["Piece", "Segment", "Span", "StateLayout", "ROW_FIELDS"]

ROWS_CHUNK = 1 << 16  # elements per kernel row: the unit of the thread split (a multiple of BLOCK)
ROW_FIELDS = ("offset", "numel", "phase", "side", "block")
"""Columns of :meth:`Span.rows` (int64): element offset in the span, elements, phase (the
first element's index in its parameter mod BLOCK; -1: not quantized), offset in the span's
``side`` array, offset in the span's ``absmax`` array."""


@dataclass(frozen=True)
class Piece:
    """Elements [first, first + numel) of a parameter of ``param_numel`` elements (0: padding,
    which belongs to no parameter), as they follow each other in a rank's run; ``keep_fp32``:
    the parameter's moments stay fp32 (``StatePolicy.fp32_moments``)."""

    param_numel: int
    first: int
    numel: int
    keep_fp32: bool = False


@dataclass(frozen=True)
class Segment:
    """A stretch of the run stored alike: one quantized parameter piece, or a run of
    unquantized elements. ``side`` / ``block``: entries of those arrays before it (8-bit
    moments only; 0 otherwise)."""

    start: int
    numel: int
    phase: int  # -1: unquantized
    side: int
    block: int

    @property
    def end(self) -> int:
        return self.start + self.numel

    @property
    def quantized(self) -> bool:
        return self.phase >= 0

    @property
    def blocks(self) -> int:
        return (self.phase + self.numel + BLOCK - 1) // BLOCK if self.quantized else 0

    def blocks_before(self, k: int) -> int:
        """Blocks of this segment wholly before its element ``k`` (a boundary)."""
        if not self.quantized or k <= 0:
            return 0
        return (self.phase + k) // BLOCK if k < self.numel else self.blocks

    def side_before(self, k: int) -> int:
        return 0 if self.quantized else max(0, min(k, self.numel))


@dataclass(frozen=True)
class Span:
    """Rank-run elements [lo, hi) and the slices of each state array they own."""

    layout: "StateLayout"
    lo: int
    hi: int
    side_lo: int
    side_hi: int
    block_lo: int
    block_hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def side_numel(self) -> int:
        return self.side_hi - self.side_lo

    @property
    def blocks(self) -> int:
        return self.block_hi - self.block_lo

    @property
    def policy(self) -> StatePolicy:
        return self.layout.policy

    def component_bytes(self) -> dict[str, int]:
        """Bytes of each state component over the span: ``master`` (with the compensation
        term when there is one) and each moment by name (values + absmax + side)."""
        pol = self.policy
        out = {"master": pol.master_bytes(self.numel)}
        for name in pol.moment_names:
            out[name] = pol.moment_bytes(self.numel, self.blocks, self.side_numel)
        return out

    @property
    def nbytes(self) -> int:
        """All the span's state bytes (what a sub-group's file holds, before alignment)."""
        return sum(self.component_bytes().values())

    def segments(self) -> list[Segment]:
        """The layout's segments clipped to the span, offsets relative to the span."""
        out = []
        for seg in self.layout.segments_between(self.lo, self.hi):
            a, b = max(seg.start, self.lo), min(seg.end, self.hi)
            k = a - seg.start
            phase = (seg.phase + k) % BLOCK if seg.quantized else -1
            side = seg.side + seg.side_before(k) - self.side_lo
            block = seg.block + seg.blocks_before(k) - self.block_lo
            out.append(Segment(a - self.lo, b - a, phase, side, block))
        return out

    def rows(self, chunk: int = ROWS_CHUNK) -> np.ndarray:
        """The kernel's work list: the span's segments cut into rows of at most ``chunk``
        elements on block boundaries (columns :data:`ROW_FIELDS`). Rows are independent, so
        any split of them across threads gives the same bits."""
        if chunk < BLOCK or chunk % BLOCK:
            raise ValueError(f"chunk must be a positive multiple of {BLOCK}, got {chunk}")
        rows: list[tuple[int, int, int, int, int]] = []
        for seg in self.segments():
            k = 0
            while k < seg.numel:
                if seg.quantized:
                    # up to the next block boundary past k + chunk - (partial first block)
                    head = (BLOCK - (seg.phase + k) % BLOCK) % BLOCK
                    n = min(seg.numel - k, head + chunk - (BLOCK if head else 0))
                    phase = (seg.phase + k) % BLOCK
                    rows.append((seg.start + k, n, phase, 0, seg.block + seg.blocks_before(k)))
                else:
                    n = min(seg.numel - k, chunk)
                    rows.append((seg.start + k, n, -1, seg.side + k, 0))
                k += n
        return np.asarray(rows, dtype=np.int64).reshape(-1, len(ROW_FIELDS))


class StateLayout:
    """The segments of one rank's run of ``numel`` elements under ``policy``."""

    def __init__(self, policy: StatePolicy, segments: Sequence[Segment], numel: int) -> None:
        self.policy = policy
        self.segments = tuple(segments)
        self.numel = numel
        self._starts = [s.start for s in self.segments]
        last = self.segments[-1] if self.segments else None
        self.blocks = 0 if last is None else last.block + last.blocks
        self.side_numel = (
            0 if last is None or not policy.quantized else last.side + last.side_before(last.numel)
        )

    @classmethod
    def build(cls, policy: StatePolicy, pieces: Iterable[Piece]) -> "StateLayout":
        """A layout from the run's pieces in order (parameters and padding)."""
        segments: list[Segment] = []
        start = side = block = 0
        for p in pieces:
            if p.numel <= 0:
                continue
            quantized = (
                policy.quantized and p.param_numel >= MIN_QUANTIZED_NUMEL and not p.keep_fp32
            )
            prev = segments[-1] if segments else None
            if not quantized and prev is not None and not prev.quantized:
                segments[-1] = Segment(prev.start, prev.numel + p.numel, -1, prev.side, prev.block)
            elif quantized:
                segments.append(Segment(start, p.numel, p.first % BLOCK, side, block))
                block += segments[-1].blocks
            else:
                segments.append(Segment(start, p.numel, -1, side, block))
            if not quantized:
                side += p.numel
            start += p.numel
        if not policy.quantized and segments:  # every element alike: no side array at all
            segments = [Segment(0, start, -1, 0, 0)]
        return cls(policy, segments, start)

    @classmethod
    def uniform(cls, policy: StatePolicy, numel: int) -> "StateLayout":
        """One parameter of ``numel`` elements (an optimizer class's tensor, a benchmark)."""
        return cls.build(policy, [Piece(numel, 0, numel)])

    @classmethod
    def for_shards(
        cls, policy: StatePolicy, units: Iterable[tuple[FlatLayout, int]]
    ) -> "StateLayout":
        """The run of a rank's shards: (unit layout, shard index) in run order. Each shard
        contributes its parameter pieces and its padding."""
        pieces: list[Piece] = []
        for flat, shard in units:
            lo, hi = flat.shard_range(shard)
            at = lo
            for ov in flat.overlaps(shard):
                slot = flat.slots[ov.slot]
                begin = slot.offset + ov.slot_start
                if begin > at:
                    pieces.append(Piece(0, 0, begin - at))
                keep = slot.name in policy.fp32_moments
                pieces.append(Piece(slot.numel, ov.slot_start, ov.numel, keep))
                at = begin + ov.numel
            if hi > at:
                pieces.append(Piece(0, 0, hi - at))
        return cls.build(policy, pieces)

    def segments_between(self, lo: int, hi: int) -> Sequence[Segment]:
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        j = bisect.bisect_left(self._starts, hi)
        return self.segments[i:j]

    def _segment_at(self, x: int) -> Segment | None:
        i = bisect.bisect_right(self._starts, x) - 1
        return self.segments[i] if i >= 0 else None

    def is_boundary(self, x: int) -> bool:
        """Can a range start or end at run element ``x`` (no block straddles it)?"""
        if x <= 0 or x >= self.numel:
            return 0 <= x <= self.numel
        seg = self._segment_at(x)
        assert seg is not None
        return not seg.quantized or x == seg.start or (seg.phase + x - seg.start) % BLOCK == 0

    def floor_boundary(self, x: int) -> int:
        """The last boundary at or before ``x`` (how a sub-group's cut is placed)."""
        x = max(0, min(x, self.numel))
        seg = self._segment_at(x)
        if seg is None or not seg.quantized or x == seg.start:
            return x
        k = x - seg.start
        cut = k - (seg.phase + k) % BLOCK
        return seg.start + max(0, cut)

    def span(self, lo: int = 0, hi: int | None = None) -> Span:
        """The span of [lo, hi) (default: the whole run); both ends must be boundaries."""
        hi = self.numel if hi is None else hi
        if not 0 <= lo <= hi <= self.numel:
            raise ValueError(f"range [{lo}, {hi}) is outside the run of {self.numel} elements")
        for x in (lo, hi):
            if not self.is_boundary(x):
                raise ValueError(
                    f"element {x} cuts an 8-bit quantization block; cut ranges at "
                    f"StateLayout.floor_boundary(x) = {self.floor_boundary(x)}"
                )
        (side_lo, block_lo), (side_hi, block_hi) = self._offsets(lo), self._offsets(hi)
        return Span(self, lo, hi, side_lo, side_hi, block_lo, block_hi)

    def _offsets(self, x: int) -> tuple[int, int]:
        """(side, block) entries before boundary ``x``."""
        if x >= self.numel:
            return self.side_numel, self.blocks
        seg = self._segment_at(x)
        if seg is None or not self.policy.quantized:
            return 0, 0
        k = x - seg.start
        return seg.side + seg.side_before(k), seg.block + seg.blocks_before(k)

    @property
    def nbytes(self) -> int:
        return self.span().nbytes

    def __repr__(self) -> str:
        return (
            f"StateLayout({self.policy.describe()}, numel={self.numel}, "
            f"segments={len(self.segments)}, blocks={self.blocks}, "
            f"side={self.side_numel} ({self.side_numel * FP32_BYTES} B))"
        )
