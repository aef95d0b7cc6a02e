"""Flat units: the groups of parameters that are gathered, reduced and stepped together.

Stages 0–2 group parameters into gradient buckets of ``reduce_bucket_size`` elements; stage 3
makes one unit per module that owns parameters directly (a tied parameter belongs to the first
module that registers it). Every unit keeps the model's parameters as views into one flat
buffer in the compute dtype (``full``). In stage 3 that buffer's storage is released after use
and refilled by an all-gather, and the views — held by the module and by autograd — stay valid
because they share the storage object, not its memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..comm import Comm
from ..device import placement
from ..partition import FlatLayout, bucketize, build_layout
from ..policies import Stage

__all__ = [
    "FlatUnit",
    "UnitPlan",
    "plan_units",
    "make_unit",
    "unit_build_bytes",
    "owning_modules",
    "parameter_references",
    "persistent_buffers",
    "trainable_numel",
]


@dataclass(eq=False)
class FlatUnit:
    """A unit's data: its parameters, their layout in the flat buffer, the buffer itself and
    where its shard sits in the rank-flat order. What it is doing (gathered or not, gradients
    owed) is kept by :class:`~.unit_state.UnitStates`."""

    index: int
    params: list[nn.Parameter]
    names: list[str]
    layout: FlatLayout
    full: torch.Tensor  # padded flat params, compute dtype, on the device
    shard_offset: int  # where this unit's shard starts in the rank's flat shard buffers
    sharded_params: bool  # stage 3 and not persistent: ``full`` is only there while gathered
    views: list[torch.Tensor] = field(default_factory=list)
    frozen: bool = False  # no parameter trained at initialize: no gradients, no update

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    @property
    def full_bytes(self) -> int:
        return self.layout.padded_numel * self.full.element_size()

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.params if p.requires_grad]


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


@dataclass
class UnitPlan:
    """A unit before it has memory: its parameters, the module that owns them, its layout."""

    index: int
    names: list[str]
    params: list[nn.Parameter]
    owners: list[nn.Module]  # per parameter: the module whose reset_parameters() makes it
    layout: FlatLayout
    shard_offset: int

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    @property
    def frozen(self) -> bool:
        return not any(p.requires_grad for p in self.params)


def trainable_numel(units: "list[UnitPlan] | list[FlatUnit]") -> int:
    """Elements of the rank-flat prefix that trains (where optimizer state and gradients
    live); frozen units' shards come after it."""
    return sum(u.shard_numel for u in units if not u.frozen)


def plan_units(
    model: nn.Module, *, stage: Stage, world_size: int, bucket_size: int
) -> list[UnitPlan]:
    """Group parameters into units (stage 3: one per module that holds parameters; else
    buckets of ``bucket_size`` elements in reverse registration order, the order in which
    gradients tend to become ready) and lay each out. Frozen parameters
    (``requires_grad=False``) get units of their own, placed after the trainable ones in the
    rank-flat order: they have no gradients and no optimizer state. Touches no parameter
    memory, so a model
    on the meta device is planned too."""

    def split(group: list) -> list[list]:  # trainable first, frozen apart
        trainable = [x for x in group if x[2].requires_grad]
        frozen = [x for x in group if not x[2].requires_grad]
        return [part for part in (trainable, frozen) if part]

    owned = [(module, name, p) for module, own in owning_modules(model) for name, p in own]
    if stage.shards_params:
        groups = [
            part for m, own in owning_modules(model) for part in split([(m, n, p) for n, p in own])
        ]
    else:
        owned.reverse()
        groups = [
            [part[i] for i in b]
            for part in split(owned)
            for b in bucketize([p.numel() for _, _, p in part], bucket_size)
        ]
    num_shards = world_size if stage.shards_optimizer else 1
    plans = []
    for index, group in enumerate(groups):
        layout = build_layout(((n, p.shape) for _, n, p in group), num_shards)
        plans.append(
            UnitPlan(
                index,
                [n for _, n, _ in group],
                [p for _, _, p in group],
                [m for m, _, _ in group],
                layout,
                0,
            )
        )
    # Rank-flat order: trainable units first, so that the optimizer state and the gradients
    # cover just the prefix [0, trainable_numel(plans)); frozen shards follow.
    offset = 0
    for frozen in (False, True):
        for plan in plans:
            if plan.frozen == frozen:
                plan.shard_offset = offset
                offset += plan.shard_numel
    return plans


def parameter_references(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(param) -> every (module, attribute name) that holds it (tied weights: several)."""
    refs: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                refs.setdefault(id(p), []).append((module, name))
    return refs


def _initial_values(plan: UnitPlan) -> list[torch.Tensor]:
    """Each parameter's starting value, where it is; a parameter on the meta device is made
    by its module's ``reset_parameters()`` on the CPU, one module at a time."""
    values = {i: p.detach() for i, p in enumerate(plan.params) if not p.is_meta}
    for owner in {id(m): m for m, p in zip(plan.owners, plan.params) if p.is_meta}.values():
        reset = getattr(owner, "reset_parameters", None)
        if reset is None:
            raise ValueError(
                f"{type(owner).__name__} holds parameters on the meta device but has no "
                "reset_parameters() to create them; give it one, or build the model on a real "
                "device"
            )
        saved = dict(owner._parameters)
        for name, p in saved.items():
            if p is not None and p.is_meta:
                owner._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=torch.float32))
        try:
            with torch.no_grad():
                reset()
            made = {name: q for name, q in owner._parameters.items() if q is not None}
        finally:
            owner._parameters.update(saved)
        for i, (m, p) in enumerate(zip(plan.owners, plan.params)):
            if m is owner and p.is_meta:
                name = next(n for n, q in saved.items() if q is p)
                values[i] = made[name].detach()
    return [values[i] for i in range(len(plan.params))]


def make_unit(
    plan: UnitPlan,
    *,
    stage: Stage,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
    persistence_threshold: int,
    comm: Comm,
    refs: dict[int, list[tuple[nn.Module, str]]],
    values: list[torch.Tensor] | None = None,
    into: torch.Tensor | None = None,
) -> tuple[FlatUnit, torch.Tensor]:
    """Give a planned unit its memory: broadcast rank 0's starting values (``values``, e.g.
    pretrained weights, or the parameters' own) so every rank starts from the same weights,
    make ``full`` in the compute dtype, and point the model's parameters at their views of
    it. Returns the unit and this rank's fp32 master shard. ``into``: where ``full`` lives
    (a slice of a rank-flat fp32 buffer, stage 0); the master shard returned is then ``full``
    itself, not a copy.

    The unit is flattened where its values are (the host, for a model built there) and goes
    to the device whole, through :func:`placement.to_device`, only as this one unit: stage 3
    never has more of the model on the device than that."""
    layout = plan.layout
    if values is None:
        values = _initial_values(plan)
    where = {v.device for v in values}
    home = where.pop() if len(where) == 1 else torch.device("cpu")
    flat = torch.empty(layout.padded_numel, dtype=torch.float32, device=home)
    with torch.no_grad():
        layout.flatten_into(flat, [v.to(device=home, dtype=torch.float32) for v in values])
        master = placement.to_device(flat, device)
        del flat
        comm.broadcast(master, src=0)
    full = master.to(dtype) if into is None else into.copy_(master)
    sharded = stage.shards_params and layout.numel >= persistence_threshold
    views = layout.views(full)
    params = []
    for p, view in zip(plan.params, views):
        if p.is_meta:  # a meta tensor cannot take other data: put a new Parameter everywhere
            new = nn.Parameter(view, requires_grad=p.requires_grad)
            for module, name in refs.get(id(p), []):
                module._parameters[name] = new
            p = new
        else:
            p.data = view
        params.append(p)
    unit = FlatUnit(
        plan.index,
        params,
        plan.names,
        layout,
        full,
        plan.shard_offset,
        sharded,
        views=views,
        frozen=plan.frozen,
    )
    lo, hi = layout.shard_range(0 if layout.num_shards == 1 else rank)
    return unit, full[lo:hi] if into is not None else master[lo:hi].clone()


def unit_build_bytes(padded_numel: int, shard_numel: int, dtype_bytes: int) -> int:
    """Device bytes :func:`make_unit` holds while it makes one unit: the fp32 values (flattened
    where they are, the host for a model built on the meta device or the CPU, and moved to the
    device once), the compute-dtype copy (the values themselves in fp32), and this rank's fp32
    shard (measured by a rehearsal of Llama 2 13B and 70B to the byte)."""
    return (4 + (dtype_bytes if dtype_bytes != 4 else 0)) * padded_numel + 4 * shard_numel


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers that belong in a state dict (``register_buffer(..., persistent=False)``
    ones, e.g. rotary frequencies recomputed in ``__init__``, do not), by name."""
    out = {}
    for mod_name, module in model.named_modules():
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out[f"{mod_name}.{name}" if mod_name else name] = b
    return out
