"""Building an engine's units one at a time, so that no more than one unit of the model is
ever whole in memory (and, at stage 3, on the device)."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from ..comm import Comm
from ..config import ZeroConfig
from ..params.released import guard
from ..params.store import ParamStore
from ..params.units import FlatUnit, UnitPlan, make_unit, parameter_references
from ..progress import Progress
from ..swap.budget import FreedMemory, return_freed_memory
from ..update.updater import Updater
from .lifecycle import Leftovers
from .weights import PretrainedWeights

__all__ = ["build_units"]

log = logging.getLogger(__name__)


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
