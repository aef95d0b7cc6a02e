"""What an engine reports about itself: its full parameters (``full_state_dict``), the shard
of a frozen unit, and the bytes it holds per tier (``memory_report``).

Exports gather one unit at a time: a stage-3 model is exported on a device that could never
hold it whole.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn as nn

from ..activations.offload import ActivationOffload
from ..comm import Comm
from ..config import ZeroConfig
from ..device import placement
from ..device.streams import Streams
from ..grads.host import HostGradQueue
from ..memory.ledger import MemoryReport
from ..params.gather import ParamGatherer
from ..params.store import ParamStore
from ..params.unit_state import GatherState, UnitStates
from ..params.units import FlatUnit, persistent_buffers
from ..policies import Stage, Tier
from ..progress import Progress
from ..update.stepper import ShardStepper
from .weights import rank0_values

__all__ = ["Exportable", "frozen_shard", "full_state_dict", "memory_report"]

log = logging.getLogger(__name__)


class Exportable(Protocol):
    """The parts of an engine an export reads (the engine's state view satisfies it; this
    module never imports the engine)."""

    @property
    def comm(self) -> Comm: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def module(self) -> nn.Module: ...
    @property
    def config(self) -> ZeroConfig: ...
    @property
    def sharding(self) -> Stage: ...
    @property
    def units(self) -> list[FlatUnit]: ...
    @property
    def stepper(self) -> ShardStepper: ...
    @property
    def param_store(self) -> ParamStore | None: ...
    @property
    def streams(self) -> Streams: ...
    @property
    def unit_states(self) -> UnitStates: ...
    @property
    def grads(self) -> torch.Tensor | None: ...
    @property
    def grad_queue(self) -> HostGradQueue | None: ...
    @property
    def activations(self) -> ActivationOffload | None: ...
    @property
    def gatherer(self) -> ParamGatherer | None: ...
    @property
    def last_step_peak(self) -> int: ...
    @property
    def last_comm(self) -> dict: ...


def full_state_dict(engine: Exportable) -> dict[str, torch.Tensor]:
    """See :meth:`Engine.full_state_dict`."""
    master = engine.stepper.updater.master_values()  # where the optimizer keeps it
    values: dict[int, torch.Tensor] = {}
    progress = Progress(
        "gathering the full model",
        sum(u.layout.numel for u in engine.units),
        "parameters",
        show=engine.comm.rank == 0,
        logger=log,
    )
    for u in engine.units:  # one unit at a time on the device
        shard = (
            frozen_shard(engine, u)
            if u.frozen
            else master[u.shard_offset : u.shard_offset + u.shard_numel]
        )
        shard = placement.to_device(shard, engine.device)
        full = torch.empty(u.layout.padded_numel, dtype=torch.float32, device=engine.device)
        if u.layout.num_shards == 1:
            full.copy_(shard)
        else:
            engine.comm.all_gather(full, shard)
        for p, slot in zip(u.params, u.layout.slots):
            values[id(p)] = full[slot.offset : slot.end].view(slot.shape).cpu().clone()
        del shard, full
        progress.update(u.layout.numel)
    progress.close()
    out: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        out[name] = values[id(p)]
    buffers = persistent_buffers(engine.module)
    for name, value in zip(buffers, rank0_values(list(buffers.values()), engine.comm)):
        out[name] = value.cpu()  # rank 0's: every rank returns the same
    return out


def frozen_shard(engine: Exportable, unit: FlatUnit) -> torch.Tensor:
    """See :meth:`Engine.frozen_shard`."""
    lo, hi = unit.layout.shard_range(0 if unit.layout.num_shards == 1 else engine.comm.rank)
    if not unit.sharded_params:
        return unit.full[lo:hi].float().cpu()
    assert engine.param_store is not None
    shard, copied = engine.param_store.load(unit)
    engine.streams.wait(copied)
    return shard.float().cpu()


def memory_report(engine: Exportable) -> MemoryReport:
    """See :meth:`Engine.memory_report`."""
    rep = MemoryReport()
    for u in engine.units:
        if not u.sharded_params:
            rep.add("device", "params", u.full_bytes)
            if engine.sharding.shards_params:
                rep.persistent_param_bytes += u.full_bytes
        elif engine.unit_states.gather_state(u) is not GatherState.FREE:
            rep.add("device", "params", u.full_bytes)
        for p in u.params:  # stage 0's are views of the gradient buffer, counted below
            if p.grad is not None and not _views_of(p.grad, engine.grads):
                rep.add("device", "grads", p.grad.numel() * p.grad.element_size())
    if engine.grads is not None:
        grads_tier = Tier.HOST if engine.config.offload.optimizer_tier.offloaded else Tier.DEVICE
        rep.add(grads_tier, "grads", engine.grads.numel() * engine.grads.element_size())
    engine.stepper.add_to(rep)
    if engine.grad_queue is not None:
        engine.grad_queue.add_to(rep)
    if engine.activations is not None:
        engine.activations.add_to(rep)
    if engine.gatherer:
        rep.peak_gathered_param_bytes = max(
            engine.last_step_peak, engine.gatherer.peak_gathered_bytes
        )
    rep.comm = engine.last_comm
    return rep


def _views_of(tensor: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    return buffer is not None and tensor.untyped_storage().data_ptr() == (
        buffer.untyped_storage().data_ptr()
    )
