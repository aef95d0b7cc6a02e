"""The 8-bit dynamic quantization maps, and blockwise (de)quantization in torch.

The maps are those of bitsandbytes' 8-bit optimizers (Dettmers et al., "8-bit Optimizers via
Block-wise Quantization", 2022): 256 sorted values in [-1, 1] (signed, for Adam's m and
Lion's momentum) or [0, 1] (unsigned, for v), each a decade ``10**-k`` times a linearly
spaced fraction, so small magnitudes keep relative precision. A value is stored as the index
of the map entry nearest to it divided by its block's absmax (a tie goes to the lower
entry); it reads back as ``map[code] * absmax``.

"Nearest" is decided by comparing the two fp32 distances, as bitsandbytes does; that
decision flips at one fp32 value between neighbouring entries, computed once here
(:func:`thresholds`), so the code of ``x`` is the number of thresholds ``<= x``. The C
kernel and the torch path below both use that rule, so they agree bit for bit.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .policy import BLOCK

__all__ = ["dynamic_map", "thresholds", "quantize_blocks", "dequantize_blocks", "zero_code"]

MAP_SIZE = 256
_MAX_EXPONENT_BITS = 7


@functools.lru_cache(maxsize=None)
def _map_np(signed: bool) -> np.ndarray:
    values: list[float] = []
    for i in range(_MAX_EXPONENT_BITS):
        # decade 10**(i - 6): 2**i fractions per sign (signed) or 2**(i + 1) (unsigned),
        # the midpoints of a linspace over [0.1, 1]
        count = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1, count + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scale = 10.0 ** (-(_MAX_EXPONENT_BITS - 1) + i)
        values += (scale * mids).tolist()  # fp32 product, as the map has always been built
        if signed:
            values += (-scale * mids).tolist()
    values += [0.0, 1.0]
    assert len(values) == MAP_SIZE
    out = np.array(sorted(values), dtype=np.float32)
    assert np.all(np.diff(out) > 0)
    return out


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 map values, ascending (a new tensor)."""
    return torch.from_numpy(_map_np(signed).copy())


def zero_code(signed: bool) -> int:
    """The code of 0.0 (what a block of zeros stores)."""
    return int(np.searchsorted(_map_np(signed), 0.0))


def _ordered(x: np.ndarray) -> np.ndarray:
    """fp32 -> int64 keys in the same order as the floats (negatives mirrored)."""
    bits = x.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)


def _from_ordered(k: np.ndarray) -> np.ndarray:
    bits = np.where(k < 0, (-(k + 1)) | -0x80000000, k).astype(np.int64)
    return (bits & 0xFFFFFFFF).astype(np.uint32).view(np.float32)


@functools.lru_cache(maxsize=None)
def _thresholds_np(signed: bool) -> np.ndarray:
    code = _map_np(signed)
    lo, hi = code[:-1], code[1:]

    def right_is_nearer(x: np.ndarray) -> np.ndarray:
        return np.abs(x - hi) < np.abs(x - lo)  # fp32 arithmetic, as the quantizer does it

    # binary search, per gap, for the first fp32 value (in order) where the upper entry wins
    a, b = _ordered(lo), _ordered(hi)  # invariant: not nearer at a, nearer at b
    while np.any(b - a > 1):
        m = (a + b) // 2
        near = right_is_nearer(_from_ordered(m))
        a, b = np.where(near, a, m), np.where(near, m, b)
    return _from_ordered(b)


def thresholds(signed: bool) -> torch.Tensor:
    """The 255 decision points: ``code(x) = #{k : thresholds[k] <= x}`` (a new tensor)."""
    return torch.from_numpy(_thresholds_np(signed).copy())


def _blocked(n: int, phase: int) -> tuple[int, int]:
    """(front padding, blocks) for ``n`` elements whose first sits at ``phase`` in its block."""
    blocks = (phase + n + BLOCK - 1) // BLOCK
    return phase, blocks


def quantize_blocks(
    values: torch.Tensor, phase: int, signed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``values`` (one parameter piece, first element at ``phase`` in its block) ->
    (uint8 codes, fp32 absmax per block). A block of zeros stores absmax 0."""
    n = values.numel()
    front, blocks = _blocked(n, phase)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32)
    padded[front : front + n] = values.reshape(-1)
    grid = padded.view(blocks, BLOCK)
    absmax = grid.abs().amax(dim=1)
    inv = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    normed = grid * inv[:, None]
    codes = torch.bucketize(normed, thresholds(signed), right=True).to(torch.uint8)
    return codes.view(-1)[front : front + n].clone(), absmax


def dequantize_blocks(
    codes: torch.Tensor, absmax: torch.Tensor, phase: int, signed: bool
) -> torch.Tensor:
    """uint8 ``codes`` of one piece and its blocks' absmax -> fp32 values."""
    n = codes.numel()
    front, blocks = _blocked(n, phase)
    if absmax.numel() != blocks:
        raise ValueError(f"{n} codes at phase {phase} span {blocks} blocks, got {absmax.numel()}")
    idx = (torch.arange(n) + front) // BLOCK
    return dynamic_map(signed)[codes.reshape(-1).long()] * absmax[idx]


# The C kernel's lookup (kernels/cpu_optim.c, zo_qmap): magnitudes below 2**-23 fold into
# bucket 0, larger ones are bucketed by their float bits >> shift; each bucket holds at most
# one decision point, so an entry (base << 20 | t) gives the code as base + (low >= t).
_MAG0 = 0x34000000  # bits of 2**-23
_MAG1 = 0x3F800000  # bits of 1.0
_NEVER = 0xFFFFF


@functools.lru_cache(maxsize=None)
def lookup_table(signed: bool) -> tuple[np.ndarray, int, int]:
    """(lut uint32[2 * buckets], shift, buckets): the widest buckets (smallest table) whose
    every bucket holds at most one decision point."""
    t = _thresholds_np(signed)
    tiny = np.float32(2.0**-23)
    if np.any(np.abs(t) < tiny):
        raise AssertionError("a decision point below 2**-23: the lookup cannot fold tiny values")
    for shift in range(19, 9, -1):
        lut = _try_lut(t, shift)
        if lut is not None:
            return lut, shift, lut.size // 2
    raise AssertionError("no bucket width separates the decision points")


def _try_lut(t: np.ndarray, shift: int) -> np.ndarray | None:
    one = 1 << shift
    top = _MAG1 - _MAG0 + one
    buckets = (top >> shift) + 1
    k = np.arange(buckets, dtype=np.int64)
    lo_m = np.maximum(k << shift, 0)  # folded magnitudes covered by bucket k
    hi_m = np.minimum(((k + 1) << shift) - 1, top)

    def unfold(m: np.ndarray) -> np.ndarray:  # folded magnitude -> |x| (0 for bucket 0)
        bits = np.where(m < one, 0, m - one + _MAG0).astype(np.uint32)
        return bits.view(np.float32)

    low_mask = one - 1
    out = np.empty(2 * buckets, dtype=np.uint32)
    for sign in (0, 1):
        a, b = unfold(lo_m), unfold(hi_m)
        x_lo, x_hi = (a, b) if sign == 0 else (-b, -a)
        if sign == 0:
            x_hi = np.where(k == 0, np.float32(0.0), x_hi)  # bucket 0: every tiny x acts as 0
        else:
            x_lo = np.where(k == 0, np.float32(-0.0), x_lo)
        base = np.searchsorted(t, x_lo, side="right")  # decision points <= x_lo
        inside = np.searchsorted(t, x_hi, side="right") - base
        if np.any(inside > 1):
            return None
        thr = np.full(buckets, _NEVER, dtype=np.int64)
        has = inside == 1
        tb = t[np.minimum(base, t.size - 1)]
        folded = tb.view(np.uint32).astype(np.int64) & 0x7FFFFFFF
        folded = folded - _MAG0 + one
        low = folded & low_mask
        thr[has] = (low if sign == 0 else low_mask - low)[has]
        out[sign * buckets : (sign + 1) * buckets] = ((base << 20) | thr).astype(np.uint32)
    return out


# The AVX-512 quantizer's tables (kernels/cpu_optim.c, quantize_z). Within decade i of the
# map (|x| in [0.1, 1] * 10**(i - 6)) the code rises linearly in |x|, so a line per decade,
# lowered by half a code, gives an estimate at most one below the code (the decision points
# sit at whole codes, or 0.2 of a code above the lines' meeting point between decades). A
# span of two octaves of |x| meets at most two decades; the lower of their two lines is the
# estimate there. One compare with the decision point at the estimate corrects it.
_SPAN0 = 48  # (fp32 exponent >> 1) of 2**-31: |x| is clamped to [2**-31, 1], 16 spans


def _decades(signed: bool) -> list[tuple[float, int, int]]:
    """(scale, entries, code of the first positive entry) per decade, ascending."""
    out, code = [], MAP_SIZE // 2 if signed else 1
    for i in range(_MAX_EXPONENT_BITS):
        count = 2**i if signed else 2 ** (i + 1)
        out.append((10.0 ** (i - (_MAX_EXPONENT_BITS - 1)), count, code))
        code += count
    return out


@functools.lru_cache(maxsize=None)
def span_lines(signed: bool) -> np.ndarray:
    """float32[4, 16]: slope and offset of two lines (code units, half a code lowered) per
    span of |x| (its fp32 exponent >> 1); the estimate is floor(the lower line)."""
    dec = _decades(signed)

    def decade(y: float) -> int:
        return max(0, min(len(dec) - 1, sum(1 for s, _, _ in dec if y >= s)))

    out = np.zeros((4, 16), dtype=np.float64)
    for e in range(16):
        lo = 2.0 ** (2 * (e + _SPAN0) - 127)
        hi = float(np.nextafter(np.float32(4 * lo), np.float32(0))) if e < 15 else 1.0
        for j, y in enumerate((lo, hi)):
            scale, count, base = dec[decade(y)]
            out[2 * j, e] = count / (0.9 * scale)
            out[2 * j + 1, e] = base - 0.1 * count / 0.9 - 0.5
    return out.astype(np.float32)


def negative_offset(signed: bool) -> float:
    """A negative x's estimate is floor(this - the line's value at |x|): the signed map's
    negatives mirror its positives about code 127; the unsigned map's estimate is 0."""
    return float(MAP_SIZE - 2) if signed else -1.0e4


def byte_planes(words: np.ndarray) -> np.ndarray:
    """uint8[4, 256]: byte j (little end first) of each of 256 32-bit words."""
    w = np.ascontiguousarray(words).view(np.uint32)
    assert w.size == MAP_SIZE
    return np.stack([(w >> (8 * j)) & 0xFF for j in range(4)]).astype(np.uint8)


def threshold_words(signed: bool) -> np.ndarray:
    """The 255 decision points and a NaN (never passed) at 255, as fp32."""
    nan = np.full(1, np.nan, dtype=np.float32)
    return np.concatenate([_thresholds_np(signed), nan]).astype(np.float32)
