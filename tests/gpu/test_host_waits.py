"""Host threads that wait for a copy sleep instead of spinning a CPU core (which CPU Adam and
the I/O threads need): the events of host-bound and host-read copies are blocking ones.
Skips without CUDA; ``tests/gpu/check.sh`` runs it on a machine with a GPU."""

from __future__ import annotations

import time

import pytest
import torch

from zero_offload.device.streams import Streams
from zero_offload.grads.host import HostGradQueue
from zero_offload.grads.target import ResidentGrads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_waiting_for_a_gradient_copy_does_not_spin() -> None:
    n = 1 << 20
    streams = Streams(torch.device("cuda"))
    queue = HostGradQueue(ResidentGrads(torch.zeros(n)), streams, n, torch.float32)
    values = torch.ones(n, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # about a second of device time before the copy can run
    cpu, wall = time.process_time(), time.perf_counter()
    queue.accumulate_grad(0, values, True)
    queue.flush()  # the worker waits for the copy's event, then adds the piece
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    queue.close()
    assert wall > 0.2, "the copy was meant to wait behind the sleep"
    assert cpu < 0.5 * wall, f"{cpu:.2f} s of CPU over a {wall:.2f} s wait: a spinning wait"
