"""Gradient reduction: all-reduce (stage 0), reduce-scatter at the step (stage 1), or
reduce-scatter unit by unit during backward as each unit's gradients are ready (stages 2–3).

Every rank ends with the average over ranks of the gradients of the slice it owns (frozen
units have none: their slice stays zero and nothing is communicated for them), in the
rank's flat gradient buffer (``grads``: compute dtype on the device, or fp32 in host memory
when the optimizer is offloaded), accumulated across micro-steps.
Stages 2–3 keep no full gradient past its unit's reduction; a few reductions stay in flight
(``max_inflight``) so that communication overlaps the rest of the backward.

Every rank issues the same collectives in the same order whatever its control flow did: at
stages 2–3 units are reduced in one canonical order (:attr:`GradReducer.order`, the usual order
in which gradients arrive: reverse registration), each as soon as it and every unit before it
are complete on this rank, the rest (units this rank did not touch: zeros) at the end of the
backward. A gradient that arrives for a unit already reduced (a weight used in two reentrant
checkpoint segments: each segment runs a backward of its own) stays in ``param.grad``; the
step reduces such leftovers, and from then on those units are reduced at the end of the
backward, after their last contribution.

Which parameters had a gradient in the accumulation window is tracked too (``had_grad``, one
flag per trainable parameter in :func:`trainable_slots` order): the step updates only those,
like ``torch.optim.AdamW`` skips parameters whose ``.grad`` is None.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from typing import Callable

import torch
from torch.profiler import record_function

from ..comm import Comm, Handle
from ..params.unit_state import UnitStates
from ..params.units import FlatUnit
from ..policies import Stage
from ..weak import weak_hook
from .target import GradTarget
from .views import GradViews

__all__ = [
    "GradReducer",
    "MAX_INFLIGHT",
    "reductions_alive",
    "trainable_slots",
]

log = logging.getLogger(__name__)

MAX_INFLIGHT = 2  # reductions left in flight while backward goes on (stages 2-3)


def reductions_alive(max_inflight: int = MAX_INFLIGHT) -> int:
    """Reductions whose flat gradients and reduced shards are alive at once: the ones left in
    flight and the one being issued (it is queued before the oldest is waited for)."""
    return max_inflight + 1


def trainable_slots(units: list[FlatUnit]) -> list[tuple[FlatUnit, int]]:
    """Every parameter of the trainable units as (unit, position in the unit), in rank-flat
    order: the index of the gradient flags and of per-parameter step counts."""
    ordered = sorted((u for u in units if not u.frozen), key=lambda u: u.shard_offset)
    return [(u, i) for u in ordered for i in range(len(u.params))]


def _check_frozen(unit: FlatUnit) -> None:
    """A parameter frozen at ``initialize`` has no gradient slot: unfreezing it later would
    silently train nothing, so say so."""
    for p, name in zip(unit.params, unit.names):
        if p.grad is not None:
            raise RuntimeError(
                f"parameter {name!r} got a gradient but had requires_grad=False when "
                "zero_offload.initialize ran: which parameters train is fixed then (frozen ones "
                "get no optimizer state); set requires_grad before initialize"
            )


class GradReducer:
    def __init__(
        self,
        units: list[FlatUnit],
        states: UnitStates,
        comm: Comm,
        stage: Stage,
        target: GradTarget,
        *,
        on_reduced: Callable[[FlatUnit], None] | None = None,
        max_inflight: int = MAX_INFLIGHT,
    ) -> None:
        self.units = units
        self.states = states  # gradients owed per unit, and whether this backward ends a window
        self.comm = comm
        self.stage = stage
        self.target = target
        self.on_reduced = on_reduced  # a unit's backward is done on this rank (stage 3: free)
        # a unit's reduced gradients of a window's final backward are in the target (stepping
        # during backward); a worker thread may call it
        self.on_landed: Callable[[FlatUnit], None] | None = None
        self.max_inflight = max_inflight
        self.flattened_bytes = 0  # gradient bytes copied out of param.grad (flat buffers)
        self.slots = trainable_slots(units)
        first: dict[int, int] = {}
        for k, (u, _) in enumerate(self.slots):
            first.setdefault(id(u), k)
        self.had_grad = bytearray(len(self.slots))  # per trainable parameter, this window
        self.backwards = 0  # backwards since the gradients were last dropped
        # Canonical reduction order: reverse registration (stage 3's units are in
        # registration order, the buckets of stages 0-2 reversed already); units whose
        # gradient arrives in pieces after their hooks completed go last ("deferred").
        trainable = [u for u in units if not u.frozen]
        self.order = trainable[::-1] if stage.shards_params else trainable
        self._deferred: set[int] = set()
        self._next = 0  # position in ``order`` of the next unit to reduce this backward
        self._complete: set[int] = set()  # ids of units complete and not deferred
        self._reduced: set[int] = set()  # ids of units reduced this backward
        self._inflight: deque[tuple[FlatUnit, torch.Tensor, torch.Tensor, Handle]] = deque()
        # flat buffers of reductions done this backward, for the next units (fresh memory
        # costs a page fault per page on the host); dropped when the backward ends
        self._spare: list[tuple[torch.Tensor, Future[None] | None]] = []
        self._hooks = []
        # stage 0: param.grad is its view of the gradient buffer (where the target lends one)
        self.views = GradViews(self.slots, target) if stage.all_reduces else None
        if stage.reduces_during_backward:
            for unit in trainable:
                for i, p in enumerate(unit.params):
                    if p.requires_grad:  # weak: a hook must not keep the engine alive
                        self._hooks.append(
                            p.register_post_accumulate_grad_hook(
                                weak_hook(self._on_grad, unit, first[id(unit)] + i)
                            )
                        )

    def _flat_grads(self, unit: FlatUnit) -> torch.Tensor:
        """Take the unit's parameter gradients into one padded flat buffer, averaged over ranks."""
        flat = self._flat_buffer(unit)
        self.flattened_bytes += flat.numel() * flat.element_size()
        unit.layout.flatten_into(flat, [p.grad for p in unit.params])
        for p in unit.params:
            p.grad = None
        if self.comm.world_size > 1:
            flat.div_(self.comm.world_size)
        return flat

    def _flat_buffer(self, unit: FlatUnit) -> torch.Tensor:
        """The unit's flat gradient buffer: the front of the smallest spare that holds it, or
        a fresh one (then the smallest spares go, so that no more than
        ``reductions_alive()`` flat buffers exist, as the memory model counts)."""
        n, like = unit.layout.padded_numel, unit.full
        fits = [
            k
            for k, (t, reading) in enumerate(self._spare)
            if t.numel() >= n
            and t.dtype == like.dtype
            and t.device == like.device
            and (reading is None or reading.done())
        ]
        if fits:
            best = min(fits, key=lambda k: self._spare[k][0].numel())
            return self._spare.pop(best)[0][:n]
        self._spare.sort(key=lambda spare: spare[0].numel())
        alive = reductions_alive(self.max_inflight)
        while self._spare and len(self._spare) + len(self._inflight) + 1 > alive:
            self._spare.pop(0)
        return torch.empty(n, dtype=like.dtype, device=like.device)

    # -- stages 2-3 ------------------------------------------------------------------------
    def begin_backward(self, final: bool) -> None:
        self.states.begin_backward(final)
        self.backwards += 1
        self._next = 0
        self._complete.clear()
        self._reduced.clear()

    def _on_grad(self, unit: FlatUnit, k: int, _param: torch.Tensor) -> None:
        self.had_grad[k] = 1
        if id(unit) in self._reduced:
            return  # a late piece (reentrant backward): it waits in .grad for the step
        if self.states.grad_arrived(unit):  # its backward is done on this rank
            if self.on_reduced is not None:
                self.on_reduced(unit)
            if id(unit) not in self._deferred:
                self._complete.add(id(unit))
                self._advance()

    def _advance(self) -> None:
        """Reduce the complete units at the head of the canonical order."""
        while self._next < len(self.order) and id(self.order[self._next]) in self._complete:
            self._reduce_unit(self.order[self._next])
            self._next += 1

    @record_function("zero_offload.reduce_scatter")
    def _reduce_unit(self, unit: FlatUnit) -> None:
        if self._flatten_in_place(unit):
            return
        flat = self._flat_grads(unit)
        out = self._shard_out(unit, flat)
        handle = self.comm.reduce_scatter(out, flat, async_op=True)
        self._reduced.add(id(unit))
        self._inflight.append((unit, flat, out, handle))
        self._drain(self.max_inflight)

    def _flatten_in_place(self, unit: FlatUnit) -> bool:
        """One rank, where the target lends the unit's zeroed region (host gradients on a
        CPU device): the gradients are flattened straight into it — no flat buffer, no sum
        after (False: the target lends none)."""
        region = getattr(self.target, "region", None)
        if self.comm.world_size > 1 or region is None:
            return False
        view = region(unit.shard_offset, unit.full)
        if view is None:
            return False
        self.flattened_bytes += view.numel() * view.element_size()
        unit.layout.flatten_into(view, [p.grad for p in unit.params])
        for p in unit.params:
            p.grad = None
        self._reduced.add(id(unit))
        if self.on_landed is not None and self.states.final:
            self.on_landed(unit)
        return True

    def _shard_out(self, unit: FlatUnit, flat: torch.Tensor) -> torch.Tensor:
        """Where this rank's reduced shard of ``flat`` goes: ``flat`` itself on one rank."""
        if self.comm.world_size == 1:
            return flat
        return torch.empty(unit.shard_numel, dtype=flat.dtype, device=flat.device)

    def _drain(self, keep: int) -> None:
        while len(self._inflight) > keep:
            unit, flat, out, handle = self._inflight.popleft()
            handle.wait()
            reading = self._accumulate(unit, out)
            if self.on_landed is not None and self.states.final:
                self._tell_landed(unit, reading)
            self._spare.append((flat if flat._base is None else flat._base, reading))

    def _tell_landed(self, unit: FlatUnit, reading: Future[None] | None) -> None:
        on_landed = self.on_landed
        assert on_landed is not None
        if reading is None:  # summed in already
            on_landed(unit)
            return

        def landed(done: Future[None]) -> None:
            if done.exception() is None:  # a failed piece fails the backward: never landed
                on_landed(unit)

        reading.add_done_callback(landed)

    def _accumulate(self, unit: FlatUnit, reduced: torch.Tensor) -> Future[None] | None:
        return self.target.accumulate_grad(unit.shard_offset, reduced, self.states.final)

    def end_backward(self) -> None:
        """Reduce the rest of the canonical order (a unit this rank did not use counts as
        zeros), so that every rank issues the same collectives, and wait for all of it."""
        if self.stage.reduces_during_backward:
            for unit in self.units:
                if unit.frozen:
                    _check_frozen(unit)
                elif self.states.mark_reduced(unit):
                    if self.on_reduced is not None:
                        self.on_reduced(unit)
            for unit in self.order[self._next :]:
                self._reduce_unit(unit)
            self._next = len(self.order)
            self._drain(0)
            self._spare.clear()
            self.target.flush()
        self.states.end_pass()

    # -- the step --------------------------------------------------------------------------
    @record_function("zero_offload.reduce")
    def reduce_accumulated(self) -> torch.Tensor:
        """At the step: reduce what autograd accumulated in ``param.grad`` (stages 0-1), and
        return this rank's flags for the ranks to agree on (summed over ranks, nonzero means
        some rank had it): per trainable parameter (:func:`trainable_slots` order) whether it
        had a gradient in this window, then (stages 2-3) per unit of :attr:`order` whether
        late pieces wait in ``param.grad`` (give the agreed ones to :meth:`reduce_late`)."""
        self.states.begin_step()
        if not self.stage.reduces_during_backward:
            for k, (unit, i) in enumerate(self.slots):
                if (
                    self.views.had_grad(k)
                    if self.views is not None
                    else unit.params[i].grad is not None
                ):
                    self.had_grad[k] = 1
            self._reduce_all()
            late: list[bool] = []
        else:
            late = [any(p.grad is not None for p in u.params) for u in self.order]
            self.target.flush()  # a window with no backward: the shard reads as zeros
        return torch.tensor(list(self.had_grad) + late, dtype=torch.float64)

    def reduce_late(self, late: list[bool]) -> None:
        """Reduce the units some rank holds late pieces of (per unit of :attr:`order`, as
        agreed), in that order; from now on they are reduced at the end of the backward."""
        units = [u for u, f in zip(self.order, late) if f]
        log.info(
            "gradients of %d units arrived after their reduction (a parameter used in "
            "several reentrant backwards): reducing them at the step, and from now on at "
            "the end of the backward",
            len(units),
        )
        for unit in units:
            self._reduce_unit(unit)
        self._drain(0)
        self._spare.clear()
        self._deferred.update(id(u) for u in units)
        self.order = [u for u in self.order if id(u) not in self._deferred] + [
            u for u in self.order if id(u) in self._deferred
        ]
        self.target.flush()

    def _reduce_all(self) -> None:
        for unit in self.units:
            if unit.frozen:
                _check_frozen(unit)
                continue
            if self.stage.all_reduces and self._reduce_in_place(unit):
                continue
            flat = self._flat_grads(unit)
            if self.stage.all_reduces:
                self.comm.all_reduce(flat)
                self._accumulate(unit, flat)
            else:
                out = self._shard_out(unit, flat)
                self.comm.reduce_scatter(out, flat)
                self._accumulate(unit, out)
        self.target.flush()

    def _reduce_in_place(self, unit: FlatUnit) -> bool:
        """Stage 0: have the unit's gradients in its region of the gradient buffer (summed
        there by autograd through the params' views, or flattened into it when zeroed) and
        all-reduce them there (False: the target has no such region)."""
        view = None if self.views is None else self.views.region(unit)
        if view is None:  # not summed in place by autograd: flattened into a zeroed region
            region = getattr(self.target, "region", None)
            view = None if region is None else region(unit.shard_offset, unit.full)
            if view is None:
                return False
            unit.layout.flatten_into(view, [p.grad for p in unit.params])
            for p in unit.params:
                p.grad = None
        if self.comm.world_size > 1:
            view.div_(self.comm.world_size)
        self.comm.all_reduce(view)
        return True

    def zero(self) -> None:
        """Drop every gradient: accumulated ones, and reductions a failed backward left in
        flight (waited for, so that the ranks' collectives stay paired, then discarded)."""
        while self._inflight:
            self._inflight.popleft()[3].wait()
        self._spare.clear()
        self.target.zero_grad()
        for unit in self.units:
            for p in unit.params:
                p.grad = None
        if self.views is not None:
            self.views.point()
        self.had_grad = bytearray(len(self.slots))
        self.backwards = 0

    def counts(self) -> dict[str, float]:
        """Gradient bytes copied since the last :meth:`reset_counts`: out of ``param.grad``
        (into flat buffers, or on one rank straight into the target), and summed into the
        target after that (a copy of its own: none where they were written in place)."""
        return {
            "grad_flatten_bytes": float(self.flattened_bytes),
            "grad_add_bytes": float(getattr(self.target, "added_bytes", 0)),
        }

    def reset_counts(self) -> None:
        self.flattened_bytes = 0
        if hasattr(self.target, "added_bytes"):
            self.target.added_bytes = 0

    def inflight_buffers(self) -> list[torch.Tensor]:
        """Flat gradients and reduced shards of the reductions not yet waited for, and the
        flat buffers kept for the next ones."""
        held = [t for _unit, flat, out, _handle in self._inflight for t in (flat, out)]
        return held + [t for t, _reading in self._spare]

    def remove_hooks(self) -> None:
        """Take the reducer's hooks off the params, and stage 0's views of the gradient
        buffer (through them a closed engine's buffer would stay alive)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.views is not None:
            self.views.remove()
