"""Device and pinned host memory on a GPU, and the host's waits in forward and backward:

- stage 3 with ``offload_param="cpu"`` builds and trains a model larger than a
  ``set_per_process_memory_fraction`` cap: after ``initialize`` the device holds almost
  nothing, the peak is about one unit, ``memory_allocated`` stays flat over 20 steps, and
  ``full_state_dict`` runs under the same cap;
- page-locked host memory (what ``cudaHostRegister`` locked plus torch's caching host
  allocator, ``torch.cuda.host_memory_stats``) is within 10% of the ledger's ``pinned_bytes``
  and nothing is left locked after ``close()``;
- the host waits on the GPU (event, stream, device synchronizes) zero times in forward and in
  backward, in the threads that run them (the main thread and autograd's); waits of
  backward on the gradient worker's queue (back-pressure) are counted and reported.

Skipped without CUDA; ``tests/gpu/check.sh`` runs it. Measured values go to the junit report
(``record_property``), which check.sh prints in its summary table.
"""

from __future__ import annotations

import concurrent.futures
import gc
import threading
from collections import Counter

import pytest
import torch
import torch.nn as nn
from support.models import batch, loss_fn, make

import zero_offload as zo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MiB = 2**20
CAP = 1 << 30  # device bytes the capped process may allocate
WIDTH, LAYERS = 8192, 12  # 805M params: 1.6 GB in bf16, larger than CAP
UNIT_BF16 = WIDTH * WIDTH * 2  # the largest unit (one Linear's weight) in bf16


class Big(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.fixture
def capped():
    """The caching allocator refuses to go past CAP bytes (an OOM otherwise)."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP / total)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        yield base
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        gc.collect()
        torch.cuda.empty_cache()


def test_stage3_param_offload_trains_a_model_larger_than_the_device_cap(capped, record_property):
    base = capped
    with torch.device("meta"):
        model = Big()
    engine = zo.initialize(
        model,
        stage=3,
        offload_optimizer="cpu",
        offload_param="cpu",
        dtype=torch.bfloat16,
        lr=1e-4,
        prefetch_depth=1,
    )
    after_init = torch.cuda.memory_allocated() - base
    peak_init = torch.cuda.max_memory_allocated() - base
    record_property("after_init_MiB", round(after_init / MiB, 1))
    record_property("peak_init_MiB", round(peak_init / MiB, 1))
    record_property("peak_init_per_unit", round(peak_init / UNIT_BF16, 2))
    assert after_init <= UNIT_BF16 // 4, "initialize left parameters on the device"
    # one unit at a time: in fp32 (2 bf16 units' worth) while it is flattened to bf16
    assert peak_init <= 4 * UNIT_BF16, f"initialize peaked at {peak_init / MiB:.0f} MiB"

    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(0)
    allocated = []
    for _ in range(20):
        x = torch.randn(4, WIDTH, generator=gen).to("cuda", torch.bfloat16)
        engine.backward(engine(x).float().square().mean())
        engine.step()
        allocated.append(torch.cuda.memory_allocated() - base)
    peak_step = torch.cuda.max_memory_allocated() - base
    record_property("peak_step_per_unit", round(peak_step / UNIT_BF16, 2))
    record_property(
        "allocated_steps_MiB", f"{min(allocated) / MiB:.1f}..{max(allocated) / MiB:.1f}"
    )
    assert max(allocated[1:]) - allocated[1] <= 16 * MiB, f"device memory grows: {allocated}"
    # gathered units (running + prefetch_depth ahead) and one unit's gradients
    assert peak_step <= 5 * UNIT_BF16, f"steps peaked at {peak_step / MiB:.0f} MiB"

    torch.cuda.reset_peak_memory_stats()
    sd = engine.full_state_dict()
    peak_export = torch.cuda.max_memory_allocated() - base
    record_property("peak_full_state_dict_per_unit", round(peak_export / UNIT_BF16, 2))
    assert sum(v.numel() for v in sd.values()) == LAYERS * WIDTH * WIDTH
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in sd.values())
    assert peak_export <= 4 * UNIT_BF16, "full_state_dict copied more than a unit at a time"
    engine.close()


class RegisterCounter:
    """``torch.cuda.cudart()`` that records page locks and forwards to the real runtime."""

    def __init__(self, real) -> None:
        self.real = real
        self.locked: dict[int, int] = {}
        self.sizes: Counter[int] = Counter()

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int):
        err = self.real.cudaHostRegister(ptr, nbytes, flags)
        if int(getattr(err, "value", err)) == 0:
            self.locked[ptr] = nbytes
            self.sizes[nbytes] += 1
        return err

    def cudaHostUnregister(self, ptr: int):
        self.locked.pop(ptr, None)
        return self.real.cudaHostUnregister(ptr)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


def _caching_host_bytes() -> int:
    """Bytes torch's caching host allocator holds (rounded blocks, cached ones too)."""
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


@pytest.mark.parametrize(
    "stage,opt,param,dtype",
    [
        (2, "cpu", "none", torch.bfloat16),
        (2, "cpu", "none", torch.float32),
        (3, "cpu", "cpu", torch.bfloat16),
        (3, "cpu", "none", torch.bfloat16),
        (3, "nvme", "nvme", torch.bfloat16),
        (2, "nvme", "none", torch.float32),
    ],
    ids=[
        "2-cpu-bf16",
        "2-cpu-fp32",
        "3-cpu-cpu-bf16",
        "3-cpu-none-bf16",
        "3-nvme-nvme-bf16",
        "2-nvme-fp32",
    ],
)
def test_pinned_host_memory_matches_the_ledger(
    tmp_path, monkeypatch, record_property, stage, opt, param, dtype
):
    counter = RegisterCounter(torch.cuda.cudart())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: counter)
    cached_before = _caching_host_bytes()
    torch.manual_seed(0)
    engine = zo.initialize(
        make("gpt"),
        stage=stage,
        offload_optimizer=opt,
        offload_param=param,
        nvme_path=tmp_path,
        dtype=dtype,
        lr=1e-3,
        sub_group_size=50_000,
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = batch("gpt", 4, gen)
        engine.backward(loss_fn("gpt", engine(x), y.to(engine.device)))
        engine.step()
    torch.cuda.synchronize()
    ledger = engine.memory_report().pinned_bytes
    registered = sum(counter.locked.values())
    cached = _caching_host_bytes() - cached_before
    record_property("ledger_pinned_KiB", ledger // 1024)
    record_property("registered_KiB", registered // 1024)
    record_property("caching_host_allocator_KiB", cached // 1024)
    assert ledger > 0
    assert abs(registered + cached - ledger) <= 0.1 * ledger, (
        f"pinned {registered + cached} bytes, ledger says {ledger}"
    )
    engine.close()
    assert counter.locked == {}, "close() left host memory page-locked"


class HostWaits:
    """Counts host waits on the GPU (event, stream and device synchronizes; the sync debug
    mode does not see event waits) and blocking waits on futures, in every thread but the
    library's own workers (``zo-`` threads wait for copies by design)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[str] = Counter()
        for owner, name in (
            (torch.cuda.Event, "synchronize"),
            (torch.cuda.Stream, "synchronize"),
            (torch.cuda, "synchronize"),
        ):
            self._wrap(monkeypatch, owner, name, lambda *a: True)
        self._wrap(
            monkeypatch,
            concurrent.futures.Future,
            "result",
            lambda future, *a, **k: not future.done(),
        )

    def _wrap(self, monkeypatch, owner, name: str, blocks) -> None:
        real = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner)}.{name}"

        def counted(*args, **kwargs):
            if not threading.current_thread().name.startswith("zo-") and blocks(*args, **kwargs):
                self.counts[label] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


@pytest.mark.parametrize(
    "stage,opt,param",
    [(2, "cpu", "none"), (3, "cpu", "cpu"), (3, "none", "cpu"), (3, "cpu", "none")],
)
def test_host_does_not_wait_in_forward_or_backward(monkeypatch, record_property, stage, opt, param):
    torch.manual_seed(0)
    engine = zo.initialize(
        make("gpt"),
        stage=stage,
        offload_optimizer=opt,
        offload_param=param,
        dtype=torch.bfloat16,
        lr=1e-3,
        prefetch_depth=2,
    )
    gen = torch.Generator().manual_seed(0)
    forward, backward = Counter(), Counter()
    for step in range(3):
        x, y = batch("gpt", 4, gen)
        x, y = x.to(engine.device), y.to(engine.device)
        waits = HostWaits(monkeypatch)
        loss = loss_fn("gpt", engine(x), y)
        fwd = Counter(waits.counts)
        engine.backward(loss)
        bwd = waits.counts - fwd
        monkeypatch.undo()
        if step > 0:  # the first forward records the module order
            forward += fwd
            backward += bwd
        engine.step()
    engine.close()
    queue = "Future.result"  # backward's back-pressure on the gradient worker
    record_property("forward_waits", dict(forward))
    record_property("backward_waits", dict(backward))
    assert not forward, f"the host waited in forward: {dict(forward)}"
    assert not backward - Counter({queue: backward[queue]}), (
        f"the host waited for the GPU in backward: {dict(backward)}"
    )
