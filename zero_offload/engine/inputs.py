"""Move a forward's inputs to the compute device without changing what they are.

``model(...)`` accepts any Python object: tensors inside lists, tuples, namedtuples, dicts,
``defaultdict``s, Hugging Face ``BatchEncoding``s, dataclasses, ``PackedSequence``s. The
engine moves the tensors it finds (floating ones take the compute dtype) and keeps each
container's type: a container is copied and its items replaced, never rebuilt from a
generator (which many container types cannot take). An object it does not know, or whose
tensors are all in place already, passes through untouched.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

__all__ = ["move_inputs"]


def move_inputs(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """``value`` with every tensor inside it on ``device`` (floating ones in ``dtype``)."""
    if isinstance(value, torch.Tensor):
        target = dtype if value.is_floating_point() else value.dtype
        return value.to(device=device, dtype=target)
    if isinstance(value, PackedSequence):  # batch_sizes stays on the host, as torch wants
        target = dtype if value.data.is_floating_point() else value.data.dtype
        # torch types PackedSequence.to as Tensor.to's first overload only (dtype, no device)
        return value.to(device=device, dtype=target)  # type: ignore[call-arg]
    if isinstance(value, (list, tuple)):
        items = [move_inputs(v, device, dtype) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        if isinstance(value, tuple):
            if hasattr(value, "_fields"):  # a namedtuple
                return type(value)(*items)
            return tuple(items) if type(value) is tuple else type(value)(items)
        out = copy.copy(value)  # a list (subclass): same type, attributes kept
        out[:] = items
        return out
    if isinstance(value, Mapping):
        moved = {k: move_inputs(v, device, dtype) for k, v in value.items()}
        if all(moved[k] is v for k, v in value.items()):
            return value
        if isinstance(value, MutableMapping):  # dict, defaultdict, OrderedDict, UserDict…
            mutable = copy.copy(value)
            for k, v in moved.items():
                mutable[k] = v
            return mutable
        return moved  # a read-only mapping: a plain dict with the same items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: move_inputs(getattr(value, f.name), device, dtype)
            for f in dataclasses.fields(value)
            if f.init and hasattr(value, f.name)
        }
        if all(changes[k] is getattr(value, k) for k in changes):
            return value
        return dataclasses.replace(value, **changes)
    return value
