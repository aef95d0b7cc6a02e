"""The simulated machine: a fake accelerator, fake ranks, and the engine's CUDA paths on them.

The accelerator is the ``meta`` device under ``FakeTensorMode`` (a CPU-only torch cannot even
describe fake CUDA tensors through autograd), host memory is fake ``cpu`` tensors: shapes,
dtypes and devices are real, no byte is. The other ranks are torch's fake process group:
every collective returns at once. :class:`SimulatedStreams` takes the engine down its CUDA
branches (page-locked staging buffers, copies through the side streams, events) with the
streams and events as no-ops, and a copy between host and device is a separate device
tensor, as on CUDA. :class:`SimulatedFusedAdamW` stands in for torch's fused CUDA AdamW,
which torch will not build for the meta device: one in-place kernel, no temporaries.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from ..device.streams import Streams

__all__ = ["DEVICE", "SimulatedStreams", "SimulatedFusedAdamW", "fake_world", "NoEvent"]

DEVICE = torch.device("meta")


class NoEvent:
    """An event that has always fired."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class SimulatedStreams(Streams):
    """:class:`Streams` with ``cuda`` set: the engine takes its CUDA paths; the copies happen
    (as separate tensors on the right device), the stream orderings do not."""

    def __init__(self, device: torch.device, on_transfer: Any = None) -> None:
        super().__init__(torch.device("cpu"))  # no CUDA streams to build
        self.device = device
        self.cuda = True
        self.on_transfer = on_transfer  # called with every device tensor a host copy makes

    def to_device(
        self, host: torch.Tensor, dtype: torch.dtype | None = None, *, own: bool = False
    ) -> tuple[torch.Tensor, Any]:
        dtype = dtype or host.dtype
        if host.device.type != "cpu":
            if host.dtype != dtype:
                return host.to(dtype=dtype), None
            return (host.clone() if own else host), None
        if host.dtype != dtype:
            host = host.to(dtype)
        out = torch.empty(host.shape, dtype=dtype, device=self.device)
        out.copy_(host)
        if self.on_transfer is not None:
            self.on_transfer(out)
        event = NoEvent()
        self._last_h2d = event
        return out, event

    def copy_into(self, target: torch.Tensor, values: torch.Tensor) -> Any:
        target.copy_(values)
        event = NoEvent()
        self._last_h2d = event
        return event

    def to_host(self, values: torch.Tensor, out: torch.Tensor, *, record: bool = True) -> Any:
        out.copy_(values)
        return NoEvent()

    def wait(self, event: Any) -> None:
        pass

    def handed_over(self, tensor: torch.Tensor) -> None:
        pass

    @contextlib.contextmanager
    def on_gather(self, after: Any) -> Iterator[None]:
        yield

    def finish_gather(self, shard: torch.Tensor, full: torch.Tensor) -> Any:
        return NoEvent()

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)  # page-locked on CUDA; same size


class SimulatedFusedAdamW(torch.optim.AdamW):
    """torch's AdamW marked fused, for the simulated device (``AdamW(fused=True)`` checks the
    device when it is built): the device updater then keeps the step count on the device and
    steps through torch's functional fused AdamW, its memory behaviour on CUDA."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.defaults["fused"] = True


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[FakeTensorMode]:
    """Rank 0 of ``world_size`` fake ranks, under fake tensors. The process group is torch's
    fake one (collectives return at once); an initialized real group is refused."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "a rehearsal runs its own fake process group: call it in a process "
            "that has not initialized torch.distributed"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        dist.destroy_process_group()
