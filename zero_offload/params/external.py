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

import logging
from typing import Any, Callable

import torch.nn as nn
from torch.overrides import TorchFunctionMode

__all__ = [
    "ExternalUses",
    "ReleasedAccess",
    "declared_external",
    "reads_memory",
    "register_external_parameter",
]

log = logging.getLogger(__name__)

_ATTR = "_zero_offload_external_parameters"
# Calls that read a parameter's metadata, not its memory: no gather for them (``p.grad`` in the
# gradient reducer, ``p.shape`` in a model's checks).
_METADATA_METHODS = frozenset(
    {
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "element_size",
        "stride",
        "storage_offset",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "get_device",
        "requires_grad_",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "__hash__",
        "untyped_storage",
        "data_ptr",
        "__len__",
        "_has_compatible_shallow_copy_type",
    }
)
# Attributes whose getter makes a view of the parameter's memory: those do gather.
_VIEW_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "data", "real", "imag"})


def reads_memory(func: Any) -> bool:
    """Whether a torch call (or tensor attribute getter) may reach a tensor's memory."""
    name = getattr(func, "__name__", None)
    if name == "__get__" or name == "__set__":  # an attribute of a tensor
        return (
            name == "__get__"
            and getattr(getattr(func, "__self__", None), "__name__", None) in _VIEW_ATTRIBUTES
        )
    return name not in _METADATA_METHODS


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter`` although another module owns it
    (e.g. a head that computes ``F.linear(x, self.embed.weight)``). Stage 3 then gathers the
    parameter together with ``module``'s own before its forward runs. Undeclared uses are
    found at run time too (with one warning); declaring them saves the first on-demand
    gather. Call it before :func:`zero_offload.initialize`; other stages ignore it."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"register_external_parameter needs an nn.Module, got {type(module).__name__}"
        )
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(
            f"register_external_parameter needs an nn.Parameter (e.g. "
            f"other_module.weight), got {type(parameter).__name__}"
        )
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
    """While active, calls ``on_access(param)`` before any torch call that may read memory
    and whose arguments (or the lists and tuples among them) hold a parameter that
    ``released(id(param))`` says is released now, so that it is gathered before the read."""

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

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if reads_memory(func):
            for a in args:
                self._check(a)
            for v in kwargs.values():
                self._check(v)
        return func(*args, **kwargs)


class ExternalUses:
    """Tells the user, once at WARNING and then at INFO, that a module's forward used a
    parameter another module owns (found at run time, not declared)."""

    def __init__(self) -> None:
        self._warned = False

    def note(self, user: str, name: str) -> None:
        if self._warned:
            log.info("stage 3: %s also uses parameter %r of another module", user, name)
            return
        self._warned = True
        log.warning(
            "stage 3: the forward of %s uses parameter %r, which another module owns; it was "
            "gathered on demand, and from the next step on it is gathered ahead of that use. "
            "zero_offload.register_external_parameter(module, param) before initialize "
            "declares such uses and silences this warning (further ones are logged at INFO)",
            user,
            name,
        )
