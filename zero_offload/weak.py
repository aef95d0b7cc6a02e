"""Hooks that do not keep their owner alive.

A hook registered on a parameter or a module lives as long as the model. If it held the
engine's reducer or gatherer, dropping the engine would free nothing — and torch cannot even
collect a Parameter whose hook refers back to it. So hooks hold their owner weakly and do
nothing once it is gone (the engine also removes them through their handles).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

__all__ = ["weak_hook"]


def weak_hook(method: Callable[..., Any], *bound: Any) -> Callable[..., Any]:
    """``method(*bound, *args)`` while ``method``'s object lives; None after."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any, **kwargs: Any) -> Any:
        live = ref()
        return None if live is None else live(*bound, *args, **kwargs)

    return hook
