"""Stage 3: a parameter used between gathers raises a clear error instead of crashing.

Between uses, a stage-3 parameter is a view of a flat buffer whose memory is released (its
values live sharded across the ranks). A torch call that read or wrote it there — ``p.sum()``,
``model.state_dict()``, ``print(p)``, ``p.data``, ``p.detach()`` — would touch freed memory
and could kill the interpreter. While the engine is open, such a parameter's class is
:class:`ShardedParameter`: an ``nn.Parameter`` whose ``__torch_function__`` (torch's
extension point for tensor subclasses) checks, before any call that reaches the parameter's
memory, that its storage holds its elements, and otherwise raises
:class:`ParameterNotGatheredError` naming the ways to read it. Metadata (``shape``,
``dtype``, ``requires_grad``, ``grad``) stays readable.

Inside a forward this never fires: the gatherer's :class:`~.external.ReleasedAccess` mode
runs before any subclass and gathers the parameter first. A backward runs outside that mode
(torch leaves a mode while it handles a call, and ``loss.backward()`` is one), yet autograd
runs Python there — recomputation, custom backward functions — that may read a released
parameter without calling its module: the check then asks the gatherer
(:func:`gather_when_missing`), which gathers it while a backward runs. ``close()`` (or the engine's
collection) gives the parameters back their ``nn.Parameter`` class.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn

from ..errors import ParameterNotGatheredError
from .external import reads_memory

__all__ = [
    "ParameterNotGatheredError",
    "ShardedParameter",
    "gather_when_missing",
    "guard",
    "unguard",
]

_ON_MISSING = "_zo_gather_when_missing"  # on a guarded parameter: (param) -> gathered?


def _missing(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage lacks the memory its elements need (a released stage-3 view)."""
    if t.is_meta or t.numel() == 0:
        return False
    return t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size()


def _check(value: Any) -> None:
    if isinstance(value, (list, tuple)):
        for v in value:
            _check(v)
    elif isinstance(value, ShardedParameter):
        with torch._C.DisableTorchFunctionSubclass():
            missing = _missing(value)
        gather = value.__dict__.get(_ON_MISSING) if missing else None
        if missing and not (gather is not None and gather(value)):
            raise ParameterNotGatheredError(
                f"this stage-3 parameter (shape {tuple(value.shape)}, {value.dtype}) was used "
                "outside the engine's forward, where its values are sharded across the ranks "
                "and not in memory. Read it inside `with engine.gathered_parameters():` "
                "(collective: every rank enters it), take engine.full_state_dict() "
                "(collective), or call engine.close() first: the model then holds the trained "
                "values as ordinary tensors"
            )


def _same_place(func: Any, args: tuple, kwargs: dict) -> bool:
    """``p.cpu()`` / ``p.to(...)`` that return the parameter itself (already there, e.g.
    ``module.cpu()`` on a CPU model) touch no memory."""
    name = getattr(func, "__name__", None)
    if name not in ("cpu", "to") or not args or not isinstance(args[0], torch.Tensor):
        return False
    t = args[0]
    if name == "cpu":
        return t.device.type == "cpu" and not kwargs
    if kwargs.get("copy"):
        return False
    device, dtype, _non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
    return (
        (device is None or torch.device(device) == t.device)
        and (dtype is None or dtype == t.dtype)
        and memory_format in (None, torch.preserve_format)
    )


class ShardedParameter(nn.Parameter):
    """An ``nn.Parameter`` of an open stage-3 engine (see the module docstring)."""

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if reads_memory(func) and not _same_place(func, args, kwargs):
            for a in args:
                _check(a)
            for v in kwargs.values():
                _check(v)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def guard(params: Iterable[nn.Parameter]) -> None:
    """Make plain ``nn.Parameter`` objects :class:`ShardedParameter` (the same objects: the
    model and the user's references see the change). Other subclasses keep their class."""
    for p in params:
        if type(p) is nn.Parameter:
            _retype(p, ShardedParameter)


def gather_when_missing(params: Iterable[nn.Parameter], gather: Any) -> None:
    """``gather(param) -> bool``: asked before a read of a released guarded parameter finds
    no memory; True when it gathered the parameter (the read goes on), False to raise.
    ``None`` removes it."""
    for p in params:
        if gather is None:
            p.__dict__.pop(_ON_MISSING, None)
        else:
            p.__dict__[_ON_MISSING] = gather


def unguard(params: Iterable[nn.Parameter]) -> None:
    """Give guarded parameters back the ``nn.Parameter`` class."""
    params = list(params)
    gather_when_missing(params, None)
    for p in params:
        if type(p) is ShardedParameter:
            _retype(p, nn.Parameter)


def _retype(p: nn.Parameter, cls: type[nn.Parameter]) -> None:
    p.__class__ = cls
