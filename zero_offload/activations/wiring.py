"""How the engine holds activation offload: built from its parts, and the context its forward
runs in (stage 3's gatherer outside, the offload's hooks inside, consulting the gatherer's)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import torch.nn as nn

from .offload import ActivationOffload

if TYPE_CHECKING:
    from ..config import ZeroConfig
    from ..device.streams import Streams
    from ..params.gather import ParamGatherer
    from ..params.units import FlatUnit

__all__ = ["build_offload", "forward_context"]


def _storage_keys(model: nn.Module, units: "list[FlatUnit]") -> set[int]:
    keys = {u.full.untyped_storage()._cdata for u in units}
    keys.update(b.untyped_storage()._cdata for b in model.buffers())
    return keys


def build_offload(
    config: "ZeroConfig",
    model: nn.Module,
    units: "list[FlatUnit]",
    streams: "Streams",
    gatherer: "ParamGatherer | None",
    host_limit: int,
) -> ActivationOffload | None:
    """The engine's activation offload, or None when ``offload_activations`` is off."""
    if not config.activations.offload:
        return None
    inner = (gatherer.pack_saved, gatherer.unpack_saved) if gatherer is not None else None
    return ActivationOffload(
        config.activations,
        streams,
        host_limit,
        engine_storages=lambda: _storage_keys(model, units),
        inner=inner,
    )


@contextlib.contextmanager
def forward_context(
    gatherer: "ParamGatherer | None", offload: ActivationOffload | None
) -> Iterator[None]:
    """One forward of the engine: stage 3 gathers around it, activations offloaded in it."""
    with contextlib.ExitStack() as stack:
        if gatherer is not None:
            stack.enter_context(gatherer.forward())
        if offload is not None:
            stack.enter_context(offload.forward())
        yield
