"""Stage 3 on autograd's side: which saved tensors live in a gathered unit, releasing frozen
units once their module's backward is done, and refusing CUDA graph capture.

Backward needs a released unit again only where autograd saved one of its tensors; the
gatherer tags those (:class:`SavedInUnit`) as they are saved and re-gathers the unit when one
is unpacked. Frozen units get no gradients, so no reduction releases them in backward: their
module's inputs pass through :class:`_AfterBackward`, whose backward releases them.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .units import FlatUnit

__all__ = ["SavedInUnit", "check_not_capturing", "release_after_backward", "storage_key"]


def storage_key(tensor: torch.Tensor) -> int:
    """Which storage a tensor views: the storage object itself, not its memory address (a
    freed unit has none, and tensors without memory, as in a rehearsal, all share 0)."""
    return tensor.untyped_storage()._cdata


class SavedInUnit:
    """A saved tensor that lives in a stage-3 unit: the unit must be gathered to read it."""

    __slots__ = ("unit", "tensor")

    def __init__(self, unit: FlatUnit, tensor: torch.Tensor) -> None:
        self.unit, self.tensor = unit, tensor


class _Releases(Protocol):
    def release(self, unit: FlatUnit) -> None: ...


class _AfterBackward(torch.autograd.Function):
    """Identity on a module's inputs. Its backward runs once the module's backward has
    produced the inputs' gradients, and releases the module's frozen units, which no
    gradient reduction would release."""

    @staticmethod
    def forward(
        ctx: Any, gatherer: _Releases, units: list[FlatUnit], *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.gatherer, ctx.units = gatherer, units
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        for unit in ctx.units:
            ctx.gatherer.release(unit)
        return (None, None, *grads)


def release_after_backward(
    gatherer: _Releases, units: list[FlatUnit], args: tuple, kwargs: dict
) -> tuple[tuple, dict] | None:
    """The module's inputs (those that need gradients) routed through :class:`_AfterBackward`;
    None when no gradient flows through the module (backward never needs it)."""
    slots = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    keys = [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if not slots and not keys:
        return None
    routed = _AfterBackward.apply(gatherer, units, *[t for _, t in slots + keys])
    new_args = list(args)
    for (i, _), t in zip(slots, routed):
        new_args[i] = t
    new_kwargs = dict(kwargs)
    for (k, _), t in zip(keys, routed[len(slots) :]):
        new_kwargs[k] = t
    return tuple(new_args), new_kwargs


def check_not_capturing() -> None:
    """Stage 3 resizes storages, waits on side streams and runs collectives inside hooks: none
    of it can be recorded into a CUDA graph. (No capture without an initialized CUDA: then
    this is one flag read.)"""
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "stage 3 cannot run under CUDA graph capture (torch.cuda.graph, "
            "make_graphed_callables, torch.compile mode='reduce-overhead'): its hooks gather and "
            "free parameters, which a graph cannot record. Capture a model trained at stage 0-2, "
            "or run stage 3 eagerly"
        )
