"""The optimizer-state tensors of one span, whatever their precision.

:class:`ShardState` is what a step reads and writes: the master (fp32 or bf16, plus a bf16
compensation term for ``bf16_kahan``) and each moment as its ``values`` / ``absmax`` /
``side`` arrays (see :mod:`.layout`). It can own fresh zeros (:meth:`ShardState.zeros`),
view a sub-span of a larger state without copying (:meth:`ShardState.narrow`: a host-resident
shard stepped range by range), or view one byte buffer (:meth:`ShardState.from_buffer`: an
NVMe sub-group's pipeline buffer, whose size :func:`buffer_bytes` gives). Conversion to and
from fp32 (:meth:`ShardState.to_fp32`, :meth:`ShardState.load_fp32`) serves checkpoints,
``consolidate`` and precision changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch

from .layout import Span
from .policy import MasterPrecision, MomentPrecision, StatePolicy
from .quant import dequantize_blocks, quantize_blocks

__all__ = ["MomentState", "ShardState", "buffer_bytes", "BUFFER_ALIGN"]

BUFFER_ALIGN = 64  # bytes: each array of a shared buffer starts on a cache line


@dataclass
class MomentState:
    """One moment over a span: ``values`` (fp32 / bf16 / uint8 codes, one per element);
    8-bit only: ``absmax`` (fp32 per block) and ``side`` (fp32 moments of unquantized
    elements)."""

    values: torch.Tensor
    absmax: torch.Tensor | None = None
    side: torch.Tensor | None = None


def _arrays(span: Span) -> list[tuple[str, torch.dtype, int]]:
    """(name, dtype, numel) of every array of the span's state, in storage order."""
    pol = span.policy
    master = torch.float32 if pol.master is MasterPrecision.FP32 else torch.bfloat16
    out = [("master", master, span.numel)]
    if pol.master is MasterPrecision.BF16_KAHAN:
        out.append(("compensation", torch.bfloat16, span.numel))
    values = {
        MomentPrecision.FP32: torch.float32,
        MomentPrecision.BF16: torch.bfloat16,
        MomentPrecision.INT8: torch.uint8,
    }[pol.moments]
    for name in pol.moment_names:
        out.append((name, values, span.numel))
        if pol.quantized:
            out.append((f"{name}.absmax", torch.float32, span.blocks))
            out.append((f"{name}.side", torch.float32, span.side_numel))
    return out


def _aligned(n: int) -> int:
    return -(-n // BUFFER_ALIGN) * BUFFER_ALIGN


def buffer_bytes(span: Span) -> int:
    """Bytes of one buffer holding the whole state of ``span`` (each array cache-line aligned)."""
    return sum(_aligned(n * torch.empty(0, dtype=d).element_size()) for _, d, n in _arrays(span))


@dataclass
class ShardState:
    """Master and moments of ``span``; tensors are 1-D, contiguous, on the CPU."""

    span: Span
    master: torch.Tensor
    compensation: torch.Tensor | None
    moments: dict[str, MomentState] = field(default_factory=dict)

    @property
    def policy(self) -> StatePolicy:
        return self.span.policy

    @classmethod
    def _assemble(cls, span: Span, arrays: dict[str, torch.Tensor]) -> "ShardState":
        moments = {
            name: MomentState(
                arrays[name], arrays.get(f"{name}.absmax"), arrays.get(f"{name}.side")
            )
            for name in span.policy.moment_names
        }
        return cls(span, arrays["master"], arrays.get("compensation"), moments)

    @classmethod
    def zeros(
        cls, span: Span, pin: bool = False, given: Mapping[str, torch.Tensor] | None = None
    ) -> "ShardState":
        """Fresh state: master zeros (load it), moments zero (codes of 0.0 with absmax 0).
        ``given``: arrays the caller holds already (e.g. the master it keeps), taken as they
        are instead of allocated, so the state never exists twice, not even for a moment."""
        given = given or {}
        arrays = {}
        for name, dtype, n in _arrays(span):
            t = given.get(name)
            if t is None:
                t = torch.zeros(n, dtype=dtype, pin_memory=pin)
            elif t.dtype != dtype or t.numel() != n:
                raise ValueError(
                    f"given {name!r} is {t.dtype} x {t.numel()}, the span needs {dtype} x {n}"
                )
            arrays[name] = t
        return cls._assemble(span, arrays)

    @classmethod
    def from_buffer(cls, span: Span, buffer: torch.Tensor) -> "ShardState":
        """Views of the span's arrays in ``buffer`` (uint8, at least :func:`buffer_bytes`
        long), laid out in storage order; what a file of this span holds, byte for byte."""
        need = buffer_bytes(span)
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < need:
            raise ValueError(
                f"state buffer must be 1-D uint8 of >= {need} bytes, got {buffer.dtype} "
                f"{tuple(buffer.shape)}"
            )
        arrays, at = {}, 0
        for name, dtype, n in _arrays(span):
            size = n * torch.empty(0, dtype=dtype).element_size()
            arrays[name] = buffer[at : at + size].view(dtype)
            at += _aligned(size)
        return cls._assemble(span, arrays)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every array by name, in storage order (for files and checkpoints)."""
        yield "master", self.master
        if self.compensation is not None:
            yield "compensation", self.compensation
        for name, m in self.moments.items():
            yield name, m.values
            if m.absmax is not None:
                yield f"{name}.absmax", m.absmax
            if m.side is not None:
                yield f"{name}.side", m.side

    def narrow(self, sub: Span) -> "ShardState":
        """Views of sub-span ``sub`` (a span of the same layout inside this one)."""
        s = self.span
        if sub.layout is not s.layout or not s.lo <= sub.lo <= sub.hi <= s.hi:
            raise ValueError(f"[{sub.lo}, {sub.hi}) is not inside this state's [{s.lo}, {s.hi})")
        e = slice(sub.lo - s.lo, sub.hi - s.lo)
        b = slice(sub.block_lo - s.block_lo, sub.block_hi - s.block_lo)
        d = slice(sub.side_lo - s.side_lo, sub.side_hi - s.side_lo)
        moments = {
            name: MomentState(
                m.values[e],
                None if m.absmax is None else m.absmax[b],
                None if m.side is None else m.side[d],
            )
            for name, m in self.moments.items()
        }
        comp = None if self.compensation is None else self.compensation[e]
        return ShardState(sub, self.master[e], comp, moments)

    def master_fp32(self) -> torch.Tensor:
        """The master as fp32 (with the compensation term added: the value it stands for)."""
        if self.compensation is None:
            return self.master.float()
        return self.master.float() + self.compensation.float()

    def moment_fp32(self, name: str) -> torch.Tensor:
        """One moment dequantized (or widened) to fp32, a new tensor."""
        m = self.moments[name]
        if not self.policy.quantized:
            return m.values.float()
        signed = dict(zip(self.policy.moment_names, self.policy.kind.signed_moments))[name]
        out = torch.empty(self.span.numel, dtype=torch.float32)
        assert m.absmax is not None and m.side is not None
        for seg in self.span.segments():
            dst = out[seg.start : seg.end]
            if seg.quantized:
                codes = m.values[seg.start : seg.end]
                dst.copy_(
                    dequantize_blocks(
                        codes, m.absmax[seg.block : seg.block + seg.blocks], seg.phase, signed
                    )
                )
            else:
                dst.copy_(m.side[seg.side : seg.side + seg.numel])
        return out

    def to_fp32(self) -> dict[str, torch.Tensor]:
        """``{"master": ..., <moment name>: ...}`` as fp32 tensors of the span's elements."""
        out = {"master": self.master_fp32()}
        for name in self.moments:
            out[name] = self.moment_fp32(name)
        return out

    def load_fp32(self, values: dict[str, torch.Tensor]) -> None:
        """Set the state from fp32 tensors (keys as :meth:`to_fp32`; a missing moment is left
        as it is), rounding / quantizing to this policy's precision (nearest; the Kahan
        term keeps what the bf16 master drops)."""
        if "master" in values:
            src = values["master"].reshape(-1).float()
            self.master.copy_(src)
            if self.compensation is not None:
                self.compensation.copy_(src - self.master.float())
        names = self.policy.moment_names
        for name, signed in zip(names, self.policy.kind.signed_moments):
            if name not in values:
                continue
            src = values[name].reshape(-1).float()
            m = self.moments[name]
            if not self.policy.quantized:
                m.values.copy_(src)
                continue
            assert m.absmax is not None and m.side is not None
            for seg in self.span.segments():
                piece = src[seg.start : seg.end]
                if seg.quantized:
                    codes, absmax = quantize_blocks(piece, seg.phase, signed)
                    m.values[seg.start : seg.end].copy_(codes)
                    m.absmax[seg.block : seg.block + seg.blocks].copy_(absmax)
                else:
                    m.side[seg.side : seg.side + seg.numel].copy_(piece)
