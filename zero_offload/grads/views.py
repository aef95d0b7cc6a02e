"""Stage 0: each ``param.grad`` is its view of the gradient buffer.

With the gradient buffer beside the params and in their dtype, autograd can sum straight into
it: no second copy of the gradients alive at the end of backward, no flatten at the step.
What a loop may do to ``.grad`` between backward and step still counts: a gradient set to None
is not applied, a tensor put in its place is, and a parameter that backward did not reach is
not stepped (a post-accumulate hook notes the ones it reached, since a view is never None).
"""

from __future__ import annotations

from typing import Any

import torch

from ..params.units import FlatUnit
from ..weak import weak_hook

__all__ = ["GradViews"]


class GradViews:
    """The params' views of the target's gradient buffer, per trainable slot (``slots``:
    :func:`~.grads.trainable_slots`); a slot has none when the target lends no region for
    good (:meth:`~.grads.ResidentGrads.alias`) or its param does not train."""

    def __init__(self, slots: list[tuple[FlatUnit, int]], target: Any) -> None:
        self.slots = slots
        alias = getattr(target, "alias", None)
        self._regions: dict[int, torch.Tensor] = {}  # id(unit) -> its part of the buffer
        self._first: dict[int, int] = {}  # id(unit) -> its first slot
        views: dict[int, list[torch.Tensor]] = {}
        self.views: list[torch.Tensor | None] = []
        for k, (unit, i) in enumerate(slots):
            if id(unit) not in views:
                self._first[id(unit)] = k
                region = None if alias is None else alias(unit.shard_offset, unit.full)
                views[id(unit)] = [] if region is None else unit.layout.views(region)
                if region is not None:
                    self._regions[id(unit)] = region
            mine = views[id(unit)]
            self.views.append(mine[i] if mine and unit.params[i].requires_grad else None)
        self._reached = bytearray(len(slots))
        self._hooks = [
            unit.params[i].register_post_accumulate_grad_hook(weak_hook(self._on_reached, k))
            for k, (unit, i) in enumerate(slots)
            if self.views[k] is not None
        ]
        self.point()

    def point(self) -> None:
        """Every param's ``.grad`` back to its view (after the gradients were dropped)."""
        self._reached = bytearray(len(self.slots))
        for (unit, i), view in zip(self.slots, self.views):
            if view is not None:
                unit.params[i].grad = view

    def _on_reached(self, k: int, _param: torch.Tensor) -> None:
        self._reached[k] = 1

    def _is_view(self, k: int, grad: torch.Tensor | None) -> bool:
        view = self.views[k]
        return (
            grad is not None
            and view is not None
            and grad.data_ptr() == view.data_ptr()
            and grad.shape == view.shape
        )

    def had_grad(self, k: int) -> bool:
        """Whether slot ``k``'s param has a gradient to apply: backward reached it, or the
        caller put a tensor of its own in ``.grad``."""
        unit, i = self.slots[k]
        grad = unit.params[i].grad
        return grad is not None and (bool(self._reached[k]) or not self._is_view(k, grad))

    def region(self, unit: FlatUnit) -> torch.Tensor | None:
        """The unit's region of the buffer holding its gradients as the caller left them
        (a dropped ``.grad`` zeroed there, one replaced copied in); None: no views."""
        region = self._regions.get(id(unit))
        if region is None:
            return None
        first = self._first[id(unit)]
        for i, p in enumerate(unit.params):
            own = self.views[first + i]
            if own is None or self._is_view(first + i, p.grad):
                continue
            if p.grad is None:  # dropped since backward (zero_grad(set_to_none=True))
                own.zero_()
            else:  # a tensor put there by the caller, or made after a drop
                own.copy_(p.grad)
            p.grad = own
        return region

    def remove(self) -> None:
        """Take the hooks and the views off the params (through them a closed engine's
        buffer would stay alive)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for k, (unit, i) in enumerate(self.slots):
            if self._is_view(k, unit.params[i].grad):
                unit.params[i].grad = None
