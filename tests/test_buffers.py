"""HostBuffer alignment and BufferPool sizing, budget errors and back-pressure."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from zero_offload.swap import budget as budget_mod
from zero_offload.swap.buffers import HUGE_PAGE, BufferBudgetError, BufferPool, HostBuffer

T = 10.0
MiB = 1024 * 1024


def test_host_buffer_alignment_and_views() -> None:
    buf = HostBuffer(10_000)
    assert buf.nbytes == 12_288 and buf.tensor.numel() == 12_288
    assert buf.tensor.dtype == torch.uint8 and buf.data_ptr % HUGE_PAGE == 0
    assert buf.footprint == (HUGE_PAGE if buf.huge_pages else 12_288)
    assert not buf.pinned  # no CUDA here
    v = buf.view(torch.float32, (3, 1000))
    v.fill_(2.5)
    assert buf.tensor[:4].view(torch.float32).item() == 2.5
    with pytest.raises(ValueError):
        buf.view(torch.float64, (2000,))
    buf.close()
    buf.close()  # idempotent


def test_pool_sized_by_budget() -> None:
    with BufferPool(3 * MiB, needed=5, host_memory_limit=3 * 4 * MiB) as pool:
        assert pool.count == 3 and pool.buffer_bytes == 3 * MiB
        assert pool.nbytes == 3 * 4 * MiB  # each 3 MiB buffer takes two huge pages
        assert pool.available == 3
    with BufferPool(MiB, needed=2, host_memory_limit=1 << 30) as pool:
        assert pool.count == 2


def test_budget_error_names_limit_and_minimum() -> None:
    with pytest.raises(BufferBudgetError) as info:
        BufferPool(4 * MiB, needed=8, minimum=3, host_memory_limit=10 * MiB)
    err = info.value
    assert isinstance(err, ValueError)
    assert "host_memory_limit=10485760" in str(err) and str(3 * 4 * MiB) in str(err)
    assert err.required == 12 * MiB


def test_default_budget_is_the_ranks_host_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half of the available memory, for a node running one rank (swap.budget)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(
        budget_mod.psutil, "virtual_memory", lambda: SimpleNamespace(available=9 * MiB)
    )
    with pytest.raises(BufferBudgetError, match="host_memory_limit=4718592"):
        BufferPool(2 * MiB, needed=4, minimum=3)
    with BufferPool(2 * MiB, needed=4) as pool:
        assert pool.count == 2 and pool.host_memory_limit == int(9 * MiB * 0.5)
    assert psutil.virtual_memory is not None


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        BufferPool(0, needed=1)
    with pytest.raises(ValueError):
        BufferPool(MiB, needed=1, minimum=2)


def test_acquire_blocks_until_release() -> None:
    with BufferPool(4096, needed=1, host_memory_limit=1 << 30) as pool:
        first = pool.acquire()
        got: list[object] = []
        started = threading.Event()

        def waiter() -> None:
            started.set()
            got.append(pool.acquire(timeout=T))

        th = threading.Thread(target=waiter)
        th.start()
        started.wait(T)
        time.sleep(0.2)
        assert got == []  # back-pressure: still waiting
        pool.release(first)
        th.join(T)
        assert got == [first]
        pool.release(first)


def test_timeout_foreign_and_double_release() -> None:
    with (
        BufferPool(4096, needed=1, host_memory_limit=1 << 30) as pool,
        BufferPool(4096, needed=1, host_memory_limit=1 << 30) as other,
    ):
        buf = pool.acquire()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="host_memory_limit"):
            pool.acquire(timeout=0.1)
        assert time.monotonic() - t0 < 5
        with pytest.raises(ValueError, match="does not belong"):
            pool.release(other.acquire())
        pool.release(buf)
        with pytest.raises(ValueError, match="already free"):
            pool.release(buf)


def test_borrow_and_close_wake_waiters() -> None:
    pool = BufferPool(4096, needed=1, host_memory_limit=1 << 30)
    with pool.borrow(timeout=T) as buf:
        assert pool.available == 0
        buf.tensor.fill_(1)
    assert pool.available == 1
    held = pool.acquire()
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            pool.acquire(timeout=T)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.1)
    del held
    pool.close()
    th.join(T)
    assert not th.is_alive() and isinstance(errors[0], RuntimeError)
    with pytest.raises(RuntimeError):
        pool.acquire(timeout=0)


def _run_child(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter: a segfault must fail the test, not kill pytest."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
        check=False,
    )


def test_views_keep_their_mapping_alive_after_close() -> None:
    res = _run_child("""
        import gc, torch
        from zero_offload.swap.buffers import BufferPool, HostBuffer
        pool = BufferPool(4 << 20, needed=2, host_memory_limit=1 << 30)
        out = pool.acquire()
        view = out.view(torch.float32, (1 << 20,))
        view.fill_(2.0)
        raw = pool.acquire().tensor[:4096]  # a slice of the flat tensor, buffer then dropped
        raw.fill_(7)
        pool.close()
        del out
        gc.collect()
        lone = HostBuffer(8192)
        lone_view = lone.view(torch.int64, (1024,))
        lone_view.fill_(5)
        lone.close()
        del lone
        gc.collect()
        print(float(view.sum()), int(raw.sum()), int(lone_view.sum()), flush=True)
        view.add_(1.0)  # still writable memory
        print(float(view[0]), flush=True)
    """)
    assert res.returncode == 0, f"child died with {res.returncode}: {res.stderr[-2000:]}"
    assert res.stdout.split() == [str(2.0 * (1 << 20)), str(7 * 4096), str(5 * 1024), "3.0"]


def test_closed_buffer_says_so() -> None:
    buf = HostBuffer(4096)
    buf.close()
    with pytest.raises(RuntimeError, match="HostBuffer is closed"):
        _ = buf.tensor
    with pytest.raises(RuntimeError, match="HostBuffer is closed"):
        buf.view(torch.uint8, (10,))


def test_release_after_close_is_a_no_op() -> None:
    pool = BufferPool(4096, needed=2, host_memory_limit=1 << 30)
    other = BufferPool(4096, needed=1, host_memory_limit=1 << 30)
    out = pool.acquire()
    pool.close()
    pool.release(out)  # a late holder giving back: nothing to do, and no buffer comes back
    pool.release(out)
    assert pool.available == 0
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(timeout=0)
    with pytest.raises(ValueError, match="does not belong"):
        pool.release(other.acquire())  # still a programming error
    other.close()
