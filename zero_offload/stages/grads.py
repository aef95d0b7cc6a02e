"""Gradient reduction: all-reduce (stage 0), reduce-scatter at the step (stage 1), or
reduce-scatter unit by unit during backward as each unit's gradients are ready (stages 2–3).

Every rank ends with the average over ranks of the gradients of the slice it owns (frozen
units have none: their slice stays zero and nothing is communicated for them), in the
rank's flat gradient buffer (``grads``: compute dtype on the device, or fp32 in host memory
when the optimizer is offloaded), accumulated across micro-steps.
Stages 2–3 keep no full gradient past its unit's reduction; a few reductions stay in flight
(``max_inflight``) so that communication overlaps the rest of the backward.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Protocol

import torch
from torch.profiler import record_function

from ..comm import Comm, Handle
from .units import FlatUnit
from .weak import weak_hook

__all__ = ["GradReducer", "GradTarget", "ResidentGrads"]


class GradTarget(Protocol):
    """Where reduced gradient shards are summed: memory (:class:`ResidentGrads`) or files
    (:class:`~.nvme_adam.NvmeAdam`)."""

    def accumulate_grad(self, offset: int, values: torch.Tensor, final: bool) -> None: ...
    def zero_grad(self) -> None: ...
    def flush(self) -> None:
        """Every piece handed over so far is summed; raise the first failure."""


class ResidentGrads:
    """The rank's gradient shard as one tensor (compute dtype on the device, or fp32 on the
    host when the optimizer is offloaded)."""

    def __init__(self, grads: torch.Tensor) -> None:
        self.grads = grads

    def accumulate_grad(self, offset: int, values: torch.Tensor, final: bool) -> None:
        self.grads[offset:offset + values.numel()].add_(values.to(self.grads.device))

    def zero_grad(self) -> None:
        self.grads.zero_()

    def flush(self) -> None:
        pass  # summed at once


def _check_frozen(unit: FlatUnit) -> None:
    """A parameter frozen at ``initialize`` has no gradient slot: unfreezing it later would
    silently train nothing, so say so."""
    for p, name in zip(unit.params, unit.names):
        if p.grad is not None:
            raise RuntimeError(
                f"parameter {name!r} got a gradient but had requires_grad=False when "
                "zero_offload.initialize ran: which parameters train is fixed then (frozen ones "
                "get no optimizer state); set requires_grad before initialize")


class GradReducer:
    def __init__(self, units: list[FlatUnit], comm: Comm, stage: int, target: GradTarget, *,
                 on_reduced: Callable[[FlatUnit], None] | None = None,
                 max_inflight: int = 2) -> None:
        self.units = units
        self.comm = comm
        self.stage = stage
        self.target = target
        self.final = True  # this backward ends an accumulation window
        self.on_reduced = on_reduced
        self.max_inflight = max_inflight
        self._inflight: deque[tuple[FlatUnit, torch.Tensor, torch.Tensor, Handle]] = deque()
        self._hooks = []
        if stage >= 2:
            for position, unit in enumerate(units):
                for p in unit.trainable:  # weak: a hook must not keep the engine alive
                    self._hooks.append(p.register_post_accumulate_grad_hook(
                        weak_hook(self._on_grad_at, position)))

    def _flat_grads(self, unit: FlatUnit) -> torch.Tensor:
        """Take the unit's parameter gradients into one padded flat buffer, averaged over ranks."""
        flat = torch.empty(unit.layout.padded_numel, dtype=unit.full.dtype, device=unit.full.device)
        unit.layout.flatten_into(flat, [p.grad for p in unit.params])
        for p in unit.params:
            p.grad = None
        if self.comm.world_size > 1:
            flat.div_(self.comm.world_size)
        return flat

    # -- stages 2-3 ------------------------------------------------------------------------
    def begin_backward(self, final: bool) -> None:
        self.final = final
        for unit in self.units:
            unit.pending_grads = len(unit.trainable)
            unit.grads_reduced = False

    def _on_grad_at(self, position: int, _param: torch.Tensor) -> None:
        self._on_grad(self.units[position])

    def _on_grad(self, unit: FlatUnit) -> None:
        unit.pending_grads -= 1
        if unit.pending_grads == 0 and not unit.grads_reduced:
            self._reduce_unit(unit)

    @record_function("zero_offload.reduce_scatter")
    def _reduce_unit(self, unit: FlatUnit) -> None:
        flat = self._flat_grads(unit)
        out = torch.empty(unit.shard_numel, dtype=flat.dtype, device=flat.device)
        handle = self.comm.reduce_scatter(out, flat, async_op=True)
        unit.grads_reduced = True
        self._inflight.append((unit, flat, out, handle))
        self._drain(self.max_inflight)
        if self.on_reduced is not None:
            self.on_reduced(unit)

    def _drain(self, keep: int) -> None:
        while len(self._inflight) > keep:
            unit, _flat, out, handle = self._inflight.popleft()
            handle.wait()
            self._accumulate(unit, out)

    def _accumulate(self, unit: FlatUnit, reduced: torch.Tensor) -> None:
        self.target.accumulate_grad(unit.shard_offset, reduced, self.final)

    def end_backward(self) -> None:
        """Reduce what no hook reduced (unused parameters count as zero gradients), in unit
        order so that every rank issues the same collectives, and wait for all of it."""
        if self.stage >= 2:
            for unit in self.units:
                if unit.frozen:
                    _check_frozen(unit)
                elif not unit.grads_reduced:
                    self._reduce_unit(unit)
            self._drain(0)
            self.target.flush()

    # -- stages 0-1 ------------------------------------------------------------------------
    @record_function("zero_offload.reduce")
    def reduce_accumulated(self) -> None:
        """At the step: reduce the gradients autograd accumulated in ``param.grad``."""
        if self.stage >= 2:
            return
        self.final = True
        for unit in self.units:
            if unit.frozen:
                _check_frozen(unit)
                continue
            flat = self._flat_grads(unit)
            if self.stage == 0:
                self.comm.all_reduce(flat)
                self._accumulate(unit, flat)
            else:
                out = torch.empty(unit.shard_numel, dtype=flat.dtype, device=flat.device)
                self.comm.reduce_scatter(out, flat)
                self._accumulate(unit, out)
        self.target.flush()

    def zero(self) -> None:
        """Drop every gradient: accumulated ones, and reductions a failed backward left in
        flight (waited for, so that the ranks' collectives stay paired, then discarded)."""
        while self._inflight:
            self._inflight.popleft()[3].wait()
        self.target.zero_grad()
        for unit in self.units:
            for p in unit.params:
                p.grad = None

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
