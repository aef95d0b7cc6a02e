"""What an engine runs on besides the model and its configuration.

The device's side streams, the worker that sums reduced gradient shards on the host, and the
device optimizer: ``initialize`` takes the real ones, and a rehearsal (the engine on a
simulated device, ``zero_offload.rehearsal``) passes simulated ones here instead of replacing
engine parts after the fact. Where the swap tier's bytes go is chosen the same way, by the
disk in effect (``zero_offload.swap.disk.use_disk``).
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..device.streams import Streams

__all__ = ["Runtime"]


@dataclass(frozen=True)
class Runtime:
    """The machine-facing parts of one engine (each default is the real one)."""

    # the side streams of the compute device (their calls run inline on a CPU device)
    streams: Callable[[torch.device], Streams] = Streams
    # runs the host-side gradient sums in order; None: a thread of the engine's own
    host_worker: Callable[[], Executor] | None = None
    # builds the optimizer of a device-resident master; None: torch's fused AdamW
    device_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None
