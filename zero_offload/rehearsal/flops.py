"""FLOPs of the rehearsed forward and backward, counted per operator.

torch's ``FlopCounterMode`` also tracks modules, and its tracker keeps tensors of the
rehearsed step alive, so the activations it measured grew. This counter only sees each
operator as it is dispatched and adds torch's own FLOP formula for it (the same registry).
"""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = ["CountFlops"]


class CountFlops(TorchDispatchMode):
    """``with CountFlops() as c: ...`` then ``c.total``: the FLOPs of the operators run."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.total += int(count(*args, **kwargs, out_val=out))
        return out
