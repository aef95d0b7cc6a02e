"""One NVMe sub-group's update in host memory, and where its new parameter values go.

The kernel steps a sub-group's (3, n) [master | m | v] where it was read (a pipeline buffer,
or host memory for the sub-groups kept there). Its new compute-dtype values go straight into
their place in the parameter store when the caller names one (``targets``), the rest into a
buffer of one sub-group; in fp32 the master itself is what the sink receives
(:class:`GroupStep`). Any other state policy's sub-group is stepped the same way, its arrays
where they were read (:class:`StateGroupStep`)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator

import torch

from ...optim import ShardState, StateLayout, StepHyper
from ...optim import step as optim_step
from ..api import Sink, StepRange, StepTimings, Targets
from ..range_step import adam_over_ranges

__all__ = ["GroupStep", "StateGroupStep"]


class GroupStep:
    """Steps sub-groups and hands their new values on, piece by piece, to a sink.
    ``out``: the compute-dtype values of one sub-group (empty in fp32)."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    def step(
        self,
        state: torch.Tensor,
        grad: torch.Tensor,
        lo: int,
        hi: int,
        factor: float,
        ranges: list[StepRange],
        hyper: dict,
        sink: Sink,
        timings: StepTimings,
        targets: Targets | None,
    ) -> None:
        """The CPU Adam on sub-group [lo, hi)'s (3, n) state, wherever it lives; elements
        outside ``ranges`` keep their values. The new compute-dtype values go straight into
        their ``targets`` (the rest into ``self.out``); each piece goes to ``sink`` once
        computed."""
        for p, q, out in self._outputs(lo, hi, targets):
            t0 = time.perf_counter()
            piece = state[:, p - lo : q - lo]
            adam_over_ranges(
                piece[0], grad[p - lo : q - lo], piece[1], piece[2], p, ranges, hyper, factor, out
            )
            timings.compute_s += time.perf_counter() - t0
            sink(p, q, piece[0] if out is None else out)

    def replay(
        self,
        values: torch.Tensor,
        lo: int,
        hi: int,
        sink: Sink,
        timings: StepTimings,
        targets: Targets | None,
    ) -> None:
        """Sub-group [lo, hi)'s new values, computed during backward, to their ``targets``
        and the ``sink`` as :meth:`step` hands them on."""
        t0 = time.perf_counter()
        for p, q, out in self._outputs(lo, hi, targets):
            piece = values[p - lo : q - lo]
            if out is not None:
                out.copy_(piece)
            sink(p, q, piece if out is None else out)
        timings.compute_s += time.perf_counter() - t0

    def _outputs(
        self, lo: int, hi: int, targets: Targets | None
    ) -> Iterator[tuple[int, int, torch.Tensor | None]]:
        """Where the kernel writes sub-group [lo, hi)'s new compute-dtype values, piece by
        piece: the ``targets`` pieces, the rest into ``self.out`` (None in fp32: the master
        only). A target is asked for only after the piece before it went to the sink (which
        may free the room it takes)."""
        if self.out.numel() == 0:
            yield lo, hi, None
            return
        at = lo
        while at < hi:
            piece = None if targets is None else targets(at, hi)
            if piece is None:
                yield at, hi, self.out[at - lo : hi - lo]
                return
            a, b, view = piece
            if at < a:
                yield at, a, self.out[at - lo : a - lo]
            yield a, b, view
            at = b


class StateGroupStep:
    """Steps a state policy's sub-groups (:class:`ShardState` views of their buffers) and
    hands their new values to a sink. ``out``: the compute-dtype values of one sub-group
    (empty where the fp32 master is them)."""

    def __init__(self, layout: StateLayout, out: torch.Tensor) -> None:
        self.layout = layout
        self.out = out

    def step(
        self,
        state: ShardState,
        grads: torch.Tensor,
        base: StepHyper,
        ranges: list[StepRange],
        sink: Sink,
        timings: StepTimings,
        num_threads: int | None,
    ) -> None:
        """The ranges' elements of one sub-group, with the rank-flat ``grads``; the rest
        keep their state and get the values their master stands for."""
        s = state.span
        out = self.out[: s.hi - s.lo] if self.out.numel() else None
        t0 = time.perf_counter()
        done = s.lo
        for lo, hi, count, decays in ranges:
            lo, hi = max(lo, s.lo), min(hi, s.hi)
            if lo >= hi:
                continue
            self._copy_master(state, out, done, lo)
            hyper = replace(base, step=count, weight_decay=base.weight_decay if decays else 0.0)
            optim_step(
                state.narrow(self.layout.span(lo, hi)),
                grads[lo:hi].to("cpu"),
                hyper,
                out=None if out is None else out[lo - s.lo : hi - s.lo],
                num_threads=num_threads,
            )
            done = hi
        self._copy_master(state, out, done, s.hi)
        timings.compute_s += time.perf_counter() - t0
        sink(s.lo, s.hi, state.master if out is None else out)

    def _copy_master(self, state: ShardState, out: torch.Tensor | None, a: int, b: int) -> None:
        if out is None or a >= b:
            return
        s = state.span
        master = state.master[a - s.lo : b - s.lo]
        if master.dtype != out.dtype:
            master = state.narrow(self.layout.span(a, b)).master_fp32()
        out[a - s.lo : b - s.lo].copy_(master)
