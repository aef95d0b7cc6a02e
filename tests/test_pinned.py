"""Which host memory is page-locked, at what size, and that it is unlocked at ``close()``,
checked on the CPU: CUDA is reported available and ``cudaHostRegister`` /
``cudaHostUnregister`` are recorded instead of called. Only what crosses PCIe is pinned — host
parameter shards, the Adam output, staging buffers, the fp32 master only in fp32 compute — at
its size rounded to a 4 KiB page, never through torch's caching host allocator (which rounds
to a power of two and keeps the blocks after the engine is gone); the ledger counts it."""

from __future__ import annotations

import gc
from collections import Counter

import pytest
import torch
from support.models import TinyGPT, batch, loss_fn

import zero_offload as zo
from zero_offload.swap import pinned
from zero_offload.update.nvme.sizing import nvme_sizing

PAGE = 4096


def page(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


class FakeCudart:
    """Records page-lock calls; succeeds like the driver would."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # address -> bytes, currently locked
        self.sizes: list[int] = []  # every registration, in order

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        assert ptr % PAGE == 0 and ptr not in self.registered
        self.registered[ptr] = nbytes
        self.sizes.append(nbytes)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        assert ptr in self.registered, "unregistered twice, or never registered"
        del self.registered[ptr]
        return 0


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)

    def no_caching_allocator(*args, **kwargs):
        raise AssertionError("pinned through torch's caching host allocator")

    # torch.empty(pin_memory=True) on a CPU-only build fails anyway; make it a clear failure
    real_empty, real_zeros = torch.empty, torch.zeros
    monkeypatch.setattr(
        torch,
        "empty",
        lambda *a, pin_memory=False, **k: (
            no_caching_allocator() if pin_memory else real_empty(*a, **k)
        ),
    )
    monkeypatch.setattr(
        torch,
        "zeros",
        lambda *a, pin_memory=False, **k: (
            no_caching_allocator() if pin_memory else real_zeros(*a, **k)
        ),
    )
    return fake


def test_host_empty_pins_exactly_what_crosses_pcie(cudart: FakeCudart) -> None:
    kept = pinned.host_empty(3000, torch.bfloat16, crosses_pcie=False)
    assert cudart.sizes == [] and pinned.pinned_nbytes(kept) == 0
    t = pinned.host_empty(3000, torch.bfloat16, crosses_pcie=True)
    assert t.shape == (3000,) and t.dtype == torch.bfloat16
    assert cudart.sizes == [page(6000)] and pinned.pinned_nbytes(t) == 8192
    view = t[100:200]
    del t
    gc.collect()
    assert len(cudart.registered) == 1, "unpinned while a view still uses the memory"
    view.fill_(1.0)
    del view
    gc.collect()
    assert cudart.registered == {}, "memory freed but still registered"
    u = pinned.host_empty(10, torch.float32, crosses_pcie=True)
    pinned.unpin(u)
    pinned.unpin(u)  # idempotent
    assert cudart.registered == {} and pinned.pinned_nbytes(u) == 0
    u.fill_(2.0)  # still valid memory, pageable now


CASES = [(2, "cpu", "none"), (2, "nvme", "none"), (3, "cpu", "cpu"), (3, "nvme", "nvme")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("stage,opt,param", CASES)
def test_engine_pins_only_what_crosses_pcie(
    tmp_path, cudart: FakeCudart, stage: int, opt: str, param: str, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    engine = zo.initialize(
        TinyGPT(),
        stage=stage,
        offload_optimizer=opt,
        offload_param=param,
        nvme_path=tmp_path,
        dtype=dtype,
        lr=1e-3,
        device="cpu",
        sub_group_size=5000,
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = batch("gpt", 4, gen)
        engine.backward(loss_fn("gpt", engine(x), y))
        engine.step()
    isz = torch.empty((), dtype=dtype).element_size()
    trainable = engine.trainable_numel
    largest = max(u.shard_numel for u in engine.units)
    expected: list[int] = []
    if opt == "cpu":
        if param == "cpu":  # the kernel writes the host shards in place; they go to the device
            expected.append(page(engine.shard_numel * isz))
        elif dtype == torch.float32:  # the master itself is the new params
            expected.append(page(trainable * 4))
        else:  # the kernel's compute-dtype output
            expected.append(page(trainable * isz))
    else:
        group = nvme_sizing(trainable, 5000, 1 << 40, isz).group  # the budget does not bind
        if dtype == torch.float32:  # master (with m, v) buffers are the new params' source
            pool = engine.swappers[0].pool
            expected += [pool.buffer_bytes] * pool.count
        else:
            expected.append(page(group * isz))  # the sub-group's compute-dtype output
        expected.append(page(largest * isz))  # units cut by sub-groups are assembled here
        if param == "nvme":  # shards read from disk are copied to the device
            pool = engine.swappers[1].pool
            expected += [pool.buffer_bytes] * pool.count
    assert Counter(cudart.sizes) == Counter(expected)
    report = engine.memory_report()
    assert report.pinned_bytes == sum(expected) == sum(cudart.registered.values())
    assert report.pinned_bytes <= report.total("host") + page(largest * isz)
    engine.close()
    assert cudart.registered == {}, "close() left host memory page-locked"
