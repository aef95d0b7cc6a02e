"""Deterministic stochastic rounding to bf16: the random bits of element ``i`` at one step
come from a hash of (seed, step, stream, i), never from a generator's state, so a result does
not depend on how elements are split across threads, ranges or ISAs. The C kernel computes
the same hash; these torch versions are the fallback and the tests' reference."""

from __future__ import annotations

import torch

__all__ = ["fmix32", "stream_seed", "sr_bits", "round_bf16_stochastic", "STREAMS"]

_M32 = 0xFFFFFFFF
STREAMS = {"master": 0, "moments": 1}
"""Random streams: the master's, and the moments' (one 32-bit hash per element rounds both:
the first moment takes its low 16 bits, the second its high 16)."""


def _fmix32_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    x ^= x >> 16
    return x


def stream_seed(seed: int, step: int, stream: int) -> int:
    """The 32-bit key of one state's rounding at one step (folded in Python, once)."""
    s = _fmix32_int((seed & _M32) ^ 0x9E3779B9)
    s = _fmix32_int(s ^ (step & _M32))
    return _fmix32_int(s ^ ((step >> 32) & _M32) ^ (0x632BE5AB * (stream + 1) & _M32))


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for int64 tensors holding uint32 values, without overflow."""
    lo, hi = a & 0xFFFF, a >> 16
    return (lo * c + ((hi * (c & 0xFFFF)) << 16)) & _M32


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors of uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def sr_bits(index_base: int, n: int, key: int, high: bool = False) -> torch.Tensor:
    """16 random bits per element ``index_base + i`` (index mod 2**32) for stream ``key``:
    the hash's low half, or its high half."""
    idx = (torch.arange(n, dtype=torch.int64) + index_base) & _M32
    h = fmix32(idx ^ key)
    return (h >> 16) if high else (h & 0xFFFF)


def round_bf16_stochastic(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, rounding up in magnitude with probability (dropped bits) / 2**16: add
    16 random bits below the kept ones, then truncate. NaN becomes bf16's canonical NaN."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & _M32
    r = ((u + bits) & 0xFFFF0000) >> 16
    r = torch.where(torch.isnan(x), torch.full_like(r, 0x7FC0), r)
    r = torch.where(r >= 0x8000, r - 0x10000, r)  # as a signed 16-bit pattern
    return r.to(torch.int16).view(torch.bfloat16)
