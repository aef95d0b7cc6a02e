"""What each unit is doing now, in one place: whether its parameters are gathered (and the
all-gather or event a use waits on), how many of its gradients this backward still owes and
whether they were reduced, and which pass the engine is in.

Units (:class:`~.units.FlatUnit`) are plain data; the gatherer (stage 3), the gradient
reducer (stages 0–3) and the hand-back at ``close`` change a unit's state only through
:class:`UnitStates`, the way FSDP2 keeps a ``TrainingState`` beside sharded/unsharded
parameter states rather than flags on the parameters.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import torch

from ..comm import Comm, Handle
from ..device.streams import Streams
from ..interrupts import holds_signals
from ..swap.buffers import advise_huge_pages
from .shared import SharedStorage, can_share
from .units import FlatUnit

__all__ = ["GatherState", "TrainingState", "UnitStates"]


class TrainingState(enum.Enum):
    """The pass the engine is in. Forward hooks also run outside both (a ``generate()``
    loop: IDLE) and inside backward (recomputation by ``torch.utils.checkpoint``)."""

    IDLE = "idle"
    FORWARD = "forward"  # the engine's forward: the order of gathers is recorded
    BACKWARD = "backward"


class GatherState(enum.Enum):
    FREE = "free"  # ``full`` holds no memory (stage 3, between uses)
    PENDING = "pending"  # all-gather issued, not waited for
    GATHERED = "gathered"


@dataclass
class _State:
    gather: GatherState
    handle: Handle | None = None  # the async all-gather (no CUDA streams)
    ready: "torch.cuda.Event | None" = None  # CUDA: fires when ``full`` is filled
    then: Callable[[], None] | None = None  # once the all-gather read the shard (no CUDA)
    shared: SharedStorage | None = None  # ``full`` is the shard's memory (one rank, a host)
    pending_grads: int = 0  # gradients still to arrive in this backward (stages 2-3)
    grads_reduced: bool = False  # this backward's gradients were handed to the reduction


class UnitStates:
    """The per-unit state of one engine's units and the engine's :class:`TrainingState`.
    Units come from ``build_units`` with every stage-3 (``sharded_params``) unit released."""

    def __init__(self, units: list[FlatUnit], comm: Comm, streams: Streams) -> None:
        self.comm = comm
        self.streams = streams
        self.training = TrainingState.IDLE
        self.final = True  # this backward ends an accumulation window
        self._units = units
        # bytes of gathers on this rank: copied into fresh storage with no communication
        # (one rank), and gathered by sharing the shard's memory instead (no copy)
        self.copied_bytes = 0
        self.shared_bytes = 0
        self._of = {
            id(u): _State(GatherState.FREE if u.sharded_params else GatherState.GATHERED)
            for u in units
        }

    def counts(self) -> dict[str, float]:
        """Bytes gathered on this rank since the last :meth:`reset_counts`: copied with no
        collective (one rank), and shared with the shard instead (no copy)."""
        return {
            "gather_copy_bytes": float(self.copied_bytes),
            "gathered_shared_bytes": float(self.shared_bytes),
        }

    def reset_counts(self) -> None:
        self.copied_bytes = self.shared_bytes = 0

    # -- the engine's pass ------------------------------------------------------------------
    @property
    def in_forward(self) -> bool:
        return self.training is TrainingState.FORWARD

    @property
    def in_backward(self) -> bool:
        return self.training is TrainingState.BACKWARD

    def begin_forward(self) -> None:
        self.training = TrainingState.FORWARD

    def begin_backward(self, final: bool) -> None:
        """A backward starts: every unit owes the gradients of its trainable parameters."""
        self.training = TrainingState.BACKWARD
        self.final = final
        for unit in self._units:
            state = self._of[id(unit)]
            state.pending_grads = len(unit.trainable)
            state.grads_reduced = False

    def end_pass(self) -> None:
        """Back to IDLE (a pass ended, or failed)."""
        self.training = TrainingState.IDLE

    def begin_step(self) -> None:
        """The step reduces what is left (stages 0-1, late pieces): the window ends there."""
        self.training = TrainingState.IDLE
        self.final = True

    # -- gathering (stage 3) ----------------------------------------------------------------
    def gather_state(self, unit: FlatUnit) -> GatherState:
        return self._of[id(unit)].gather

    @holds_signals
    def gather(
        self,
        unit: FlatUnit,
        shard: torch.Tensor,
        wait: bool,
        after: "torch.cuda.Event | None" = None,
        then: Callable[[], None] | None = None,
        share: bool = False,
    ) -> bool:
        """Start filling ``unit.full`` from every rank's ``shard`` (``wait``: and wait for
        it); True if work was issued. With CUDA streams the all-gather runs on the gather
        stream once ``after`` (the shard's copy to the device) has fired; :meth:`wait` then
        orders the compute stream after it without blocking the host. Without them,
        ``then`` runs once the all-gather is done with ``shard`` (the store's buffer it
        lent goes back). ``share``: the caller lends ``shard``'s memory until ``then``; on
        one rank, where the shard is the whole unit, ``full`` then is that memory until
        :meth:`free` (which runs ``then``), and nothing is copied."""
        state = self._of[id(unit)]
        assert then is None or not self.streams.cuda, "a device shard is the store's own"
        if state.gather is not GatherState.FREE:
            if then is not None:
                then()
            return False
        if (
            share
            and self.comm.world_size == 1
            and not self.streams.cuda
            and can_share(unit.full, shard)
        ):
            self.comm.count_all_gather(unit.full)  # what the collective would have moved
            state.shared, state.then = SharedStorage(unit.full, shard), then
            state.gather = GatherState.GATHERED
            self.shared_bytes += unit.full_bytes
            return True
        unit.full.untyped_storage().resize_(unit.full_bytes)  # allocated on the compute stream
        if not self.streams.cuda:
            advise_huge_pages(unit.full)  # fresh host memory each pass, not yet written
        if self.streams.cuda:
            with self.streams.on_gather(after):
                self.comm.all_gather(unit.full, shard, async_op=True).wait()  # a stream wait
                state.ready = self.streams.finish_gather(shard, unit.full)
        else:
            if self.comm.world_size == 1:
                self.copied_bytes += unit.full_bytes
            try:
                state.handle = self.comm.all_gather(unit.full, shard, async_op=not wait)
            except BaseException:
                if then is not None:
                    then()
                raise
            if then is not None and self.comm.world_size == 1:  # copied already
                then()
            else:
                state.then = then
        state.gather = GatherState.PENDING
        if wait:
            self.wait(unit)
        return True

    @holds_signals
    def wait(self, unit: FlatUnit) -> None:
        """The gathered parameters may be used after this (by work queued after it)."""
        state = self._of[id(unit)]
        if state.gather is not GatherState.PENDING:
            return
        if state.ready is not None:
            self.streams.wait(state.ready)
            state.ready = None
        else:
            assert state.handle is not None
            handle, then, state.handle, state.then = state.handle, state.then, None, None
            try:
                handle.wait()
            finally:
                if then is not None:
                    then()
        state.gather = GatherState.GATHERED

    @holds_signals
    def free(self, unit: FlatUnit) -> bool:
        """Release ``unit.full``'s memory (stage-3 units only); True if memory was released."""
        state = self._of[id(unit)]
        if not unit.sharded_params or state.gather is GatherState.FREE:
            return False
        self.wait(unit)
        if state.shared is not None:  # the lender's memory again
            shared, then, state.shared, state.then = state.shared, state.then, None, None
            shared.end()
            if then is not None:
                then()
        else:
            unit.full.untyped_storage().resize_(0)
        state.gather = GatherState.FREE
        return True

    # -- gradients (stages 2-3) -------------------------------------------------------------
    def grad_arrived(self, unit: FlatUnit) -> bool:
        """One of the unit's gradients is in; True when that makes the unit's backward done
        on this rank (its last gradient, not reduced yet): it is marked reduced then."""
        state = self._of[id(unit)]
        state.pending_grads -= 1
        return state.pending_grads == 0 and self.mark_reduced(unit)

    def mark_reduced(self, unit: FlatUnit) -> bool:
        """Mark the unit's gradients of this backward as handed to the reduction; True if
        they were not already."""
        state = self._of[id(unit)]
        if state.grads_reduced:
            return False
        state.grads_reduced = True
        return True

    def grads_reduced(self, unit: FlatUnit) -> bool:
        return self._of[id(unit)].grads_reduced
