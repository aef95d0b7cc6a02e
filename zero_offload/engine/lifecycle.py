"""The engine's lifecycle: refusing work once closed, lending stage-3 parameters their values
outside a forward (``gathered_parameters``), and ``close()``, which hands the trained
parameters back to the model and releases hooks, threads, files and buffers.

:class:`EngineLifecycle` is a part of :class:`zero_offload.Engine`, which builds the
attributes declared here.

What an engine leaves in the model when it ends is below: ``close()`` hands every parameter a
plain tensor of its own (:func:`hand_back_parameters`); an engine collected without it is
released by :class:`Leftovers`, from a finalizer.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, TypeVar

import torch
import torch.nn as nn

from ..policies import Stage
from ..update.window import Phase
from .forward import broadcast_buffers

if TYPE_CHECKING:
    from ..comm import Comm
    from ..config import ZeroConfig
    from ..grads.host import HostGradQueue
    from ..grads.reducer import GradReducer
    from ..params.gather import ParamGatherer
    from ..params.store import ParamStore
    from ..params.unit_state import UnitStates
    from ..params.units import FlatUnit
    from ..update.stepper import ShardStepper
    from ..update.window import WindowCoordinator
    from .forward import ForwardWindow
from ..params.released import unguard
from ..params.store import ParamStore
from ..params.unit_state import UnitStates
from ..params.units import FlatUnit

__all__ = ["EngineLifecycle", "Leftovers", "check_parameters", "hand_back_parameters", "has_memory"]

log = logging.getLogger("zero_offload.engine.engine")

_E = TypeVar("_E", bound="EngineLifecycle")


class EngineLifecycle:
    """Open/closed state, ``gathered_parameters`` and ``close`` of an engine."""

    config: ZeroConfig
    comm: Comm
    stage: int
    sharding: Stage
    units: list[FlatUnit]
    unit_states: UnitStates
    reducer: GradReducer
    stepper: ShardStepper
    gatherer: ParamGatherer | None
    param_store: ParamStore | None
    grads: torch.Tensor | None
    grad_queue: HostGradQueue | None
    _module: nn.Module
    _closed: bool
    coordinator: WindowCoordinator
    _window: ForwardWindow
    _finalizer: Callable[[], Any]
    _leftovers: Leftovers

    def _check_open(self, settle: bool = True) -> None:
        """Refuse a closed engine; ``settle``: first let an update still running under the
        forward (``overlap_step``) end, since what follows reads or changes training state."""
        if self._closed:
            raise RuntimeError(
                "this zero_offload engine is closed: close() handed the trained parameters back "
                "to the model; call zero_offload.initialize(model, ...) again to train on"
            )
        if settle:
            self._window.end_interrupted()  # a forward an interrupt left open ends first
            self.coordinator.settle()

    @contextlib.contextmanager
    def gathered_parameters(self, params: Iterable[nn.Parameter] | None = None) -> Iterator[None]:
        """Inside the block the model's parameters (or only ``params``) hold their current
        values, to read outside a forward: print them, take ``model.state_dict()``, evaluate
        by calling the model. At stage 3 each one holds a copy of its gathered values —
        collective: every rank enters the block, with the same ``params``; host or device
        memory for the copies — so tensors taken from them stay valid after the block, and
        changes made to them are not kept (training goes on from the optimizer's state; do
        not step inside). At stages 0-2 they hold their values anyway."""
        self._check_open()
        if self.gatherer is None:
            yield
            return
        units = self.units
        if params is not None:
            owner = {id(p): u for u in self.units for p in u.params}
            wanted = list(params)
            if any(id(p) not in owner for p in wanted):
                raise ValueError(
                    "gathered_parameters: a parameter given is not one of the "
                    "engine's model (pass model.parameters() or some of them)"
                )
            units = [owner[id(p)] for p in wanted]
        with self.coordinator.during(Phase.LENDING), self.gatherer.lend_values(units):
            yield  # the model's forwards read the lent values: no window

    def close(self, hand_back: bool = True) -> None:
        """End the engine and give the model back: each parameter becomes a plain tensor of
        its own holding the trained values in the compute dtype — on the compute device at
        stages 0–2; at stage 3 gathered unit by unit into host memory, with the buffers
        moved there too. Then hooks are removed, the gradient worker thread stops, swap files
        and host buffers are freed. The model can be initialized again. Idempotent.

        At stage 3 (world size > 1) closing gathers, so it is collective: every rank must
        call it. Called while an exception propagates (a ``finally`` block, ``with``), it
        does not communicate — the other ranks may never get there — and stage 3's sharded
        parameters are left on the meta device instead (keep values with checkpoints).
        ``hand_back=False`` does the same on purpose: for a model too large for host memory,
        after its checkpoint is saved. An engine collected without ``close()`` is released
        the same way."""
        if self._closed:
            return
        self._window.end_interrupted()
        self._closed = True
        unwinding = sys.exc_info()[0] is not None
        try:
            if unwinding:  # an update left under the forward is dropped, not finished
                self.coordinator.abandon()
            else:
                self.coordinator.settle()
            if hand_back and not unwinding:
                self._hand_back()
            self._leftovers.dropped_on_purpose = not hand_back and not unwinding
        finally:
            self._finalizer()  # hooks, threads, files (and meta placeholders where needed)
            del self.reducer, self.stepper  # every use after this is behind _check_open
            self.gatherer = self.param_store = None
            self.grads = self.grad_queue = None
            self.units = []

    def _hand_back(self) -> None:
        if self.gatherer is not None:
            self.gatherer.release_all()
            self.gatherer.end_backward()
        if self.grad_queue is not None:
            try:
                self.grad_queue.flush()
            except Exception as err:  # noqa: BLE001 - gradients are dropped anyway
                log.warning("zero_offload: close(): dropping gradients that failed: %s", err)
        if self.param_store is not None:
            self.param_store.flush()
        if self.config.broadcast_buffers:
            broadcast_buffers(self._module, self.comm)
        hand_back_parameters(
            self._module, self.units, self.sharding, self.unit_states, self.param_store
        )

    def __enter__(self: _E) -> _E:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


log = logging.getLogger(__name__)

Refs = list[tuple[nn.Module, str]]


def has_memory(p: torch.Tensor) -> bool:
    """Whether the tensor's storage holds its elements (a stage-3 view between gathers
    does not)."""
    if p.is_meta:
        return True
    needed = (p.storage_offset() + p.numel()) * p.element_size()
    return p.numel() == 0 or p.untyped_storage().nbytes() >= needed


def check_parameters(model: nn.Module) -> None:
    """A parameter without memory is a stage-3 view of an engine that is still open."""
    for name, p in model.named_parameters():
        if not has_memory(p):
            raise RuntimeError(
                f"parameter {name!r} has no memory: it belongs to a stage-3 engine that is "
                "still open; call engine.close() first (it puts the trained values back into "
                "the model), then initialize again"
            )


class Leftovers:
    """What an engine must release however it ends. It holds nothing that refers back to the
    engine, so that ``weakref.finalize`` can own it without keeping the engine alive."""

    def __init__(self) -> None:
        self.closers: list[Callable[[], None]] = []  # run in order, each one even if one fails
        self.sharded: list[tuple[nn.Parameter, Refs]] = []  # stage 3 gathered-on-demand params
        self.dropped_on_purpose = False  # close(hand_back=False): no warning, the user chose it

    def release(self) -> None:
        """Remove hooks, stop threads, close swap files; give parameters left without memory
        a meta tensor in their place."""
        lost = []
        for p, refs in self.sharded:
            if has_memory(p):
                unguard([p])  # a plain nn.Parameter again
            else:  # the old object stays guarded: a reference the user kept fails clearly
                new = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device="meta"),
                    requires_grad=p.requires_grad,
                )
                for module, name in refs:
                    module._parameters[name] = new
                lost.append(f"{type(refs[0][0]).__name__}.{refs[0][1]}" if refs else "?")
        if lost and self.dropped_on_purpose:
            log.info(
                "zero_offload: close(hand_back=False): %d stage-3 parameters are on the meta "
                "device now",
                len(lost),
            )
        elif lost:
            log.warning(
                "zero_offload: a stage-3 engine ended without close() (or during an "
                "exception): %d parameters (e.g. %s) lost their values and are on the "
                "meta device now; call engine.close() to keep trained values",
                len(lost),
                lost[0],
            )
        self.sharded.clear()
        closers, self.closers = self.closers, []
        for close in closers:
            try:
                close()
            except Exception:
                log.exception("zero_offload: releasing an engine part failed")


def _own_copy(p: nn.Parameter, value: torch.Tensor, device: torch.device) -> None:
    p.data = value.detach().to(device=device, copy=True)
    p.grad = None


def hand_back_parameters(
    model: nn.Module,
    units: list[FlatUnit],
    stage: Stage,
    states: UnitStates,
    store: ParamStore | None,
) -> None:
    """Give every parameter of ``units`` a tensor of its own with its current values (see the
    module docstring for where). Stage 3 gathers: collective, in unit order on every rank."""
    host = torch.device("cpu")
    with torch.no_grad():
        for unit in units:
            target = host if stage.shards_params else unit.full.device
            if unit.sharded_params:
                assert store is not None
                shard, copied = store.load(unit)
                states.gather(unit, shard, wait=True, after=copied)
            for p, view in zip(unit.params, unit.views):
                _own_copy(p, view, target)
            if unit.sharded_params:
                states.free(unit)
            unit.full = unit.full.new_empty(0)  # the engine keeps no copy of the values
            unit.views = []
        if stage.shards_params:
            for module in model.modules():
                for name, b in module._buffers.items():
                    if b is not None:
                        module._buffers[name] = b.to(host)
