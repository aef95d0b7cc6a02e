"""The engine's lifecycle: refusing work once closed, lending stage-3 parameters their values
outside a forward (``gathered_parameters``), and ``close()``, which hands the trained
parameters back to the model and releases hooks, threads, files and buffers.

:class:`Lifecycle` is the engine's object for these, built from the parts it hands back.

What an engine leaves in the model when it ends: ``close()`` hands every parameter a plain
tensor of its own (:func:`hand_back_parameters`); an engine collected without it is released
by ``engine.build.Leftovers``, from a finalizer.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
import torch.nn as nn

from ..comm import Comm
from ..config import ZeroConfig
from ..params.store import ParamStore
from ..params.unit_state import UnitStates
from ..params.units import FlatUnit
from ..policies import Stage
from ..update.window import Phase
from .build import Leftovers
from .weights import broadcast_buffers

if TYPE_CHECKING:
    from .build import Parts

__all__ = ["Lifecycle", "hand_back_parameters"]

log = logging.getLogger(__name__)


class Lifecycle:
    """Whether an engine is open, ``gathered_parameters`` and ``close``. It owns what must be
    released however the engine ends (``leftovers``, run by ``finalizer``, which the engine's
    collection runs too) and drops the shared ``parts`` when it closes; ``end_interrupted``
    closes a forward window an interrupt left open."""

    def __init__(
        self,
        module: nn.Module,
        config: ZeroConfig,
        comm: Comm,
        parts: Parts,
        end_interrupted: Callable[[], None],
        leftovers: Leftovers,
        finalizer: Callable[[], object],
    ) -> None:
        self._module = module
        self._config = config
        self._comm = comm
        self._parts = parts
        self._end_interrupted = end_interrupted  # the forward window's
        self._leftovers = leftovers
        self._finalizer = finalizer
        self._closed = False
        self._flattened = {id(p) for u in parts.units for p in u.params}

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self, settle: bool = True) -> None:
        """Refuse a closed engine; ``settle``: first let an update still running under the
        forward (``overlap_step``) end, since what follows reads or changes training state."""
        if self._closed:
            raise RuntimeError(
                "this zero_offload engine is closed: close() handed the trained parameters back "
                "to the model; call zero_offload.initialize(model, ...) again to train on"
            )
        if settle:
            self._end_interrupted()  # a forward an interrupt left open ends first
            self._parts.coordinator.settle()

    def check_parameters(self) -> None:
        """Refuse an update of a model whose parameters changed since ``initialize`` (a layer
        replaced or added): the engine steps the parameters it flattened then, so new ones
        would never train while ``step()`` reports updates."""
        new = [n for n, p in self._module.named_parameters() if id(p) not in self._flattened]
        if new:
            raise RuntimeError(
                f"parameters {new[:3]!r} were added to the model after initialize (a layer "
                "replaced?): the engine trains the parameters it took over at initialize. "
                "Build the model fully before zero_offload.initialize, or close() the engine "
                "and initialize again after the change"
            )

    @contextlib.contextmanager
    def gathered_parameters(self, params: Iterable[nn.Parameter] | None = None) -> Iterator[None]:
        """See :meth:`zero_offload.Engine.gathered_parameters`."""
        self.check_open()
        gatherer = self._parts.gatherer
        if gatherer is None:
            yield
            return
        units = self._parts.units
        if params is not None:
            owner = {id(p): u for u in units for p in u.params}
            wanted = list(params)
            if any(id(p) not in owner for p in wanted):
                raise ValueError(
                    "gathered_parameters: a parameter given is not one of the "
                    "engine's model (pass model.parameters() or some of them)"
                )
            units = [owner[id(p)] for p in wanted]
        with self._parts.coordinator.during(Phase.LENDING), gatherer.lend_values(units):
            yield  # the model's forwards read the lent values: no window

    def close(self, hand_back: bool = True) -> None:
        """See :meth:`zero_offload.Engine.close`."""
        if self._closed:
            return
        self._end_interrupted()
        self._closed = True
        unwinding = sys.exc_info()[0] is not None
        try:
            if unwinding:  # an update left under the forward is dropped, not finished
                self._parts.coordinator.abandon()
            else:
                self._parts.coordinator.settle()
            if hand_back and not unwinding:
                self._hand_back()
            self._leftovers.dropped_on_purpose = not hand_back and not unwinding
        finally:
            self._finalizer()  # hooks, threads, files (and meta placeholders where needed)
            self._parts.release()

    def _hand_back(self) -> None:
        parts = self._parts
        if parts.gatherer is not None:
            parts.gatherer.release_all()
            parts.gatherer.end_backward()
        if parts.grad_queue is not None:
            try:
                parts.grad_queue.flush()
            except Exception as err:  # noqa: BLE001 - gradients are dropped anyway
                log.warning("zero_offload: close(): dropping gradients that failed: %s", err)
        if parts.param_store is not None:
            parts.param_store.flush()
        if self._config.broadcast_buffers:
            broadcast_buffers(self._module, self._comm)
        hand_back_parameters(
            self._module, parts.units, self._config.sharding, parts.unit_states, parts.param_store
        )


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
