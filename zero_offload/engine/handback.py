"""Giving the model back: what an engine leaves in the user's module when it ends.

While an engine runs, the model's parameters are views into the units' flat buffers, and at
stage 3 those buffers have no memory between uses. Reading such a parameter after the engine
is gone would read freed memory, so an engine never ends without handing every parameter a
tensor of its own:

- ``engine.close()`` (:func:`hand_back_parameters`): each parameter gets a new plain tensor
  holding the trained values in the compute dtype. Stages 0–2 keep them on the compute device
  (they were there whole all along); stage 3 gathers its units one at a time into host
  memory (the model may not fit the device) and moves the buffers there too, so the whole
  model is on the CPU.
- An engine collected without ``close()`` (:class:`Leftovers`, run by ``weakref.finalize``)
  cannot gather, because that is collective: stage 3's gathered-on-demand parameters become
  ``meta`` tensors of the same shape (a clear error if used, and ``initialize`` makes them
  again from ``reset_parameters()``). Everything else is released the same way as by
  ``close()``: hooks, the gradient worker thread, swap files.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn as nn

from ..params.released import unguard
from ..params.store import ParamStore
from ..params.unit_state import UnitStates
from ..params.units import FlatUnit
from ..policies import Stage

__all__ = ["Leftovers", "check_parameters", "hand_back_parameters", "has_memory"]

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
