"""Flat units: the groups of parameters that are gathered, reduced and stepped together.

Stages 0–2 group parameters into gradient buckets of ``reduce_bucket_size`` elements; stage 3
makes one unit per module that owns parameters directly (a tied parameter belongs to the first
module that registers it). Every unit keeps the model's parameters as views into one flat
buffer in the compute dtype (``full``). In stage 3 that buffer's storage is released after use
and refilled by an all-gather, and the views — held by the module and by autograd — stay valid
because they share the storage object, not its memory.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..comm import Comm, Handle
from ..partition import FlatLayout, bucketize, build_layout

__all__ = ["FlatUnit", "GatherState", "build_units", "owning_modules"]


class GatherState(enum.Enum):
    FREE = "free"
    PENDING = "pending"  # all-gather issued, not waited for
    GATHERED = "gathered"


@dataclass(eq=False)
class FlatUnit:
    index: int
    params: list[nn.Parameter]
    names: list[str]
    layout: FlatLayout
    full: torch.Tensor  # padded flat params, compute dtype, on the device
    shard_offset: int  # where this unit's shard starts in the rank's flat shard buffers
    sharded_params: bool  # stage 3 and not persistent: ``full`` is only there while gathered
    state: GatherState = GatherState.GATHERED
    handle: Handle | None = None
    param_shard: torch.Tensor | None = None  # this rank's slice of the low-precision params
    pending_grads: int = 0  # grads still to arrive in this backward (stages 2-3)
    grads_reduced: bool = False  # this backward's gradients were reduced already
    views: list[torch.Tensor] = field(default_factory=list)
    initial_master: torch.Tensor | None = None  # fp32 shard at start, taken by the optimizer

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    @property
    def full_bytes(self) -> int:
        return self.layout.padded_numel * self.full.element_size()

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.params if p.requires_grad]

    # -- stage 3: gather / free ------------------------------------------------------------
    def gather(self, comm: Comm, async_op: bool) -> bool:
        """Start (or finish) filling ``full`` from every rank's shard; True if work was issued."""
        if self.state is not GatherState.FREE:
            return False
        self.full.untyped_storage().resize_(self.full_bytes)
        self.handle = comm.all_gather(self.full, self.param_shard, async_op=async_op)
        self.state = GatherState.PENDING
        if not async_op:
            self.wait()
        return True

    def wait(self) -> None:
        if self.state is GatherState.PENDING:
            assert self.handle is not None
            self.handle.wait()
            self.handle = None
            self.state = GatherState.GATHERED

    def free(self) -> bool:
        """Release ``full``'s memory (stage 3 units only); True if memory was released."""
        if not self.sharded_params or self.state is GatherState.FREE:
            return False
        self.wait()
        self.full.untyped_storage().resize_(0)
        self.state = GatherState.FREE
        return True


def owning_modules(model: nn.Module) -> list[tuple[nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Modules that hold parameters directly, in registration order, with their new (not yet
    seen) parameters; a tied parameter goes to the first module that holds it."""
    seen: set[int] = set()
    out = []
    for mod_name, module in model.named_modules():
        own = []
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                own.append((f"{mod_name}.{p_name}" if mod_name else p_name, p))
        if own:
            out.append((module, own))
    return out


def build_units(model: nn.Module, *, stage: int, world_size: int, rank: int,
                dtype: torch.dtype, device: torch.device, bucket_size: int,
                persistence_threshold: int, comm: Comm) -> list[FlatUnit]:
    """Group the model's parameters into units, broadcast rank 0's values so that every rank
    starts from the same weights, and point each parameter at its view of ``full``.

    Each unit's ``initial_master`` holds this rank's fp32 shard of the starting weights, for the
    optimizer's master copy.
    """
    if stage == 3:
        groups = [own for _, own in owning_modules(model)]
    else:
        named = [pair for _, own in owning_modules(model) for pair in own]
        # Reverse registration order approximates the order in which gradients become ready.
        named.reverse()
        groups = [[named[i] for i in b] for b in bucketize([p.numel() for _, p in named], bucket_size)]
    num_shards = 1 if stage == 0 else world_size
    units: list[FlatUnit] = []
    offset = 0
    for index, group in enumerate(groups):
        layout = build_layout(((n, p.shape) for n, p in group), num_shards)
        params = [p for _, p in group]
        master = torch.empty(layout.padded_numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            layout.flatten_into(master, [p.detach().to(device=device, dtype=torch.float32)
                                         for p in params])
            comm.broadcast(master, src=0)
        full = master.to(dtype)
        sharded = stage == 3 and layout.numel >= persistence_threshold
        unit = FlatUnit(index, params, [n for n, _ in group], layout, full, offset, sharded)
        unit.views = layout.views(full)
        for p, view in zip(params, unit.views):
            p.data = view
        shard = 0 if num_shards == 1 else rank
        lo, hi = layout.shard_range(shard)
        unit.initial_master = master[lo:hi].clone()
        offset += layout.shard_numel
        units.append(unit)
    return units
