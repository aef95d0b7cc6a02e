"""Building an engine's units one at a time, so that no more than one unit of the model is
ever whole in memory (and, at stage 3, on the device); what a build leaves to release however
the engine ends (:class:`Leftovers`); and :class:`Parts`, what the engine trains with, which
``engine.parts.build_parts`` builds and the engine's objects share."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..activations.offload import ActivationOffload
from ..comm import Comm
from ..config import ZeroConfig
from ..grads.host import HostGradQueue
from ..grads.reducer import GradReducer
from ..params.gather import ParamGatherer
from ..params.released import guard, unguard
from ..params.store import ParamStore
from ..params.unit_state import UnitStates
from ..params.units import FlatUnit, UnitPlan, make_unit, parameter_references
from ..progress import Progress
from ..swap.budget import FreedMemory, return_freed_memory
from ..update.stepper import ShardStepper
from ..update.updater import Updater
from ..update.window import WindowCoordinator
from .weights import PretrainedWeights

__all__ = ["Leftovers", "Parts", "build_units", "check_parameters", "has_memory"]

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


@dataclass
class Parts:
    """What an engine trains with: one object the engine's forward driver, lifecycle and
    state view share, so that ``close()`` releases each part once, for all of them."""

    param_store: ParamStore | None
    trainable_numel: int
    shard_numel: int
    units: list[FlatUnit]
    grads: torch.Tensor | None  # None: the optimizer keeps them in files
    grad_queue: HostGradQueue | None
    unit_states: UnitStates
    gatherer: ParamGatherer | None
    reducer: GradReducer
    activations: ActivationOffload | None
    stepper: ShardStepper
    coordinator: WindowCoordinator  # the phase the engine is in and the window the update runs in

    def widen_grads(self, grads: torch.Tensor) -> None:
        """The host gradient shard became fp32 (a second backward before a step)."""
        self.grads = self.stepper.grads = grads

    def release(self) -> None:
        """Drop the parts that hold the run's memory (a closed engine keeps none of it, even
        while its object lives on); every use after this is behind the engine's open check."""
        del self.reducer, self.stepper
        self.gatherer = self.param_store = None
        self.grads = self.grad_queue = None
        self.units = []


def build_units(
    model: nn.Module,
    plans: list[UnitPlan],
    config: ZeroConfig,
    comm: Comm,
    device: torch.device,
    updater: Updater,
    store: ParamStore | None,
    weights: tuple[PretrainedWeights, dict[str, str]] | None,
    leftovers: Leftovers,
    flat_params: torch.Tensor | None = None,
) -> list[FlatUnit]:
    """Materialize each planned unit, streaming this rank's fp32 shard into the optimizer's
    tier and (stage 3) its compute-dtype shard into the parameter store, after which the
    unit's full buffer is released. Stage-3 parameters are put on ``leftovers`` as they lose
    their memory, so that an engine ending early (an error here) leaves none unreadable.
    ``flat_params``: the rank-flat buffer that holds the trainable units' params (stage 0's
    fp32 params, which are the optimizer's master)."""
    refs = parameter_references(model)
    units = []
    what = (
        f"loading weights from {weights[0].path}"
        if weights is not None
        else "materializing the model"
    )
    progress = Progress(
        what,
        sum(p.numel() for plan in plans for p in plan.params),
        "parameters",
        show=comm.rank == 0,
        logger=log,
    )
    freed = FreedMemory()
    for plan in plans:
        values = None
        if weights is not None:
            opened, stored = weights
            values = [opened.load(stored[name]) for name in plan.names]
        unit, master = make_unit(
            plan,
            stage=config.sharding,
            rank=comm.rank,
            dtype=config.dtype,
            device=device,
            persistence_threshold=config.param_persistence_threshold,
            comm=comm,
            refs=refs,
            values=values,
            into=None
            if flat_params is None or plan.frozen
            else flat_params[plan.shard_offset : plan.shard_offset + plan.shard_numel],
        )
        if not unit.frozen:  # a frozen unit's values live in its compute-dtype params
            updater.load_state(
                unit.shard_offset,
                master.cpu() if config.offload.optimizer_tier.offloaded else master,
            )
        if unit.sharded_params:  # released, not handed back, if the engine just ends
            leftovers.sharded.extend(
                (new, refs.get(id(old), [])) for old, new in zip(plan.params, unit.params)
            )
            guard(unit.params)  # used between gathers: a clear error, not freed memory
        if store is not None:
            lo, hi = unit.layout.shard_range(comm.rank)
            store.put(unit, unit.full[lo:hi])  # copied: ``full`` can go now
            if unit.sharded_params:  # released (UnitStates starts such units FREE)
                unit.full.untyped_storage().resize_(0)
        units.append(unit)
        freed.freed(4 * unit.layout.padded_numel)  # its fp32 build buffers are gone
        progress.update(sum(p.numel() for p in plan.params))
    progress.close()
    if store is not None:
        store.flush()
    return_freed_memory()
    return units
