"""Stage 3: parameters that a module's forward uses but does not own.

Stage 3 gathers a module's own parameters when the module is called. Models also use
parameters without calling their module: ``nn.MultiheadAttention`` reads
``self.out_proj.weight`` inside its own forward (the ``out_proj`` Linear is never called), a
tied head runs ``F.linear(x, self.embed.weight)``, a block is handed another module's weight.
Two ways cover them:

- declared up front (:func:`register_external_parameter`; ``nn.MultiheadAttention``'s
  ``out_proj`` is declared automatically): the parameter's unit is gathered with the
  module's own, before its forward runs;
- found at run time: while a stage-3 module runs, :class:`ReleasedAccess` (a
  ``TorchFunctionMode``, torch's own extension point for seeing every torch call) checks each
  call's arguments and, before a call that takes a released parameter runs, lets the gatherer
  gather it. The gatherer records the use, so from the next step on the unit is prefetched
  ahead of it like any module's.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn
from torch.overrides import TorchFunctionMode

__all__ = ["register_external_parameter", "declared_external", "ReleasedAccess"]

_ATTR = "_zero_offload_external_parameters"


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter`` although another module owns it
    (e.g. a head that computes ``F.linear(x, self.embed.weight)``). Stage 3 then gathers the
    parameter together with ``module``'s own before its forward runs. Undeclared uses are
    found at run time too (with one warning); declaring them saves the first on-demand
    gather. Call it before :func:`zero_offload.initialize`; other stages ignore it."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_external_parameter needs an nn.Module, got "
                        f"{type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"register_external_parameter needs an nn.Parameter (e.g. "
                        f"other_module.weight), got {type(parameter).__name__}")
    declared = module.__dict__.setdefault(_ATTR, [])
    if not any(p is parameter for p in declared):
        declared.append(parameter)


def declared_external(module: nn.Module) -> list[nn.Parameter]:
    """The parameters declared for ``module``, with ``nn.MultiheadAttention``'s ``out_proj``
    (its forward reads them without calling ``out_proj``)."""
    out = list(module.__dict__.get(_ATTR, ()))
    if isinstance(module, nn.MultiheadAttention):
        out += [p for p in module.out_proj.parameters() if not any(p is q for q in out)]
    return out


class ReleasedAccess(TorchFunctionMode):
    """While active, calls ``on_access(param)`` before any torch call whose arguments (or the
    lists and tuples among them) hold a parameter in ``watched`` (id -> whether it is released
    now), so that the parameter is gathered before the call reads it."""

    def __init__(self, released: Callable[[int], bool], on_access: Callable[[Any], None]) -> None:
        super().__init__()
        self._released = released
        self._on_access = on_access

    def _check(self, value: Any) -> None:
        if isinstance(value, (list, tuple)):
            for v in value:
                if self._released(id(v)):
                    self._on_access(v)
        elif self._released(id(value)):
            self._on_access(value)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        for a in args:
            self._check(a)
        if kwargs:
            for v in kwargs.values():
                self._check(v)
        else:
            kwargs = {}
        return func(*args, **kwargs)
