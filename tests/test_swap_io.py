"""FileIOEngine: round trips, many in flight, and every failure mode ending in SwapIOError."""

from __future__ import annotations

import asyncio
import errno
import logging
import threading
import time
from pathlib import Path

import pytest
import torch
from support.swap_faults import FaultBackend

from zero_offload.errors import SwapIOError
from zero_offload.swap.buffers import BufferPool, HostBuffer
from zero_offload.swap.io import FileIOEngine, OsBackend

BLOCK = 16 * 1024
T = 10  # seconds: no test may hang


def _filled(nbytes: int, seed: int) -> HostBuffer:
    buf = HostBuffer(nbytes)
    g = torch.Generator().manual_seed(seed)
    buf.tensor.copy_(torch.randint(0, 256, (buf.nbytes,), dtype=torch.uint8, generator=g))
    return buf


def _write_plain(path: Path, buf: HostBuffer) -> None:
    with FileIOEngine(BLOCK, 2) as eng:
        eng.write(path, buf.tensor).result(T)


@pytest.fixture
def engine():
    with FileIOEngine(block_size=BLOCK, queue_depth=4) as e:
        yield e


def test_round_trip_size_not_multiple_of_block(engine: FileIOEngine, tmp_path: Path) -> None:
    nbytes = 5 * BLOCK + 3 * 4096
    src, dst = _filled(nbytes, 1), HostBuffer(nbytes)
    engine.write(tmp_path / "a.swp", src.tensor).result(T)
    assert (tmp_path / "a.swp").stat().st_size == nbytes
    engine.read(tmp_path / "a.swp", dst.tensor).result(T)
    assert torch.equal(src.tensor, dst.tensor)


def test_many_in_flight_offsets_and_files(engine: FileIOEngine, tmp_path: Path) -> None:
    chunk = 3 * BLOCK + 4096
    src = _filled(chunk * 16, 2)
    futs = [
        engine.write(tmp_path / "big.swp", src.tensor[i * chunk : (i + 1) * chunk], i * chunk)
        for i in range(16)
    ]
    futs += [
        engine.write(tmp_path / f"f{i}.swp", src.tensor[i * chunk : (i + 1) * chunk])
        for i in range(16)
    ]
    for f in futs:
        f.result(T)
    back = HostBuffer(chunk * 16)
    futs = [
        engine.read(tmp_path / "big.swp", back.tensor[i * chunk : (i + 1) * chunk], i * chunk)
        for i in range(16)
    ]
    for f in futs:
        f.result(T)
    assert torch.equal(src.tensor, back.tensor)
    one = HostBuffer(chunk)
    engine.read(tmp_path / "f7.swp", one.tensor).result(T)
    assert torch.equal(one.tensor, src.tensor[7 * chunk : 8 * chunk])


def test_reads_into_pool_buffers_and_memoryview(engine: FileIOEngine, tmp_path: Path) -> None:
    src = _filled(4 * BLOCK, 3)
    engine.write(tmp_path / "p.swp", memoryview(src.tensor.numpy())).result(T)
    with BufferPool(4 * BLOCK, 3, host_memory_limit=1 << 30) as pool:
        bufs = [pool.acquire(timeout=T) for _ in range(3)]
        futs = [engine.read(tmp_path / "p.swp", b.tensor) for b in bufs]
        for f, b in zip(futs, bufs):
            f.result(T)
            assert torch.equal(b.tensor, src.tensor)
        mv_target = memoryview(bufs[0].tensor.numpy())
        bufs[0].tensor.zero_()
        engine.read(tmp_path / "p.swp", mv_target).result(T)
        assert torch.equal(bufs[0].tensor, src.tensor)
        for b in bufs:
            pool.release(b)


def test_typed_tensor_and_async_wrappers(engine: FileIOEngine, tmp_path: Path) -> None:
    buf = HostBuffer(8192)
    x = buf.view(torch.float32, (2048,))
    x.copy_(torch.arange(2048, dtype=torch.float32))
    out = HostBuffer(8192).view(torch.float32, (2048,))

    async def go() -> None:
        await engine.write_async(tmp_path / "t.swp", x)
        await engine.read_async(tmp_path / "t.swp", out)

    asyncio.run(go())
    assert torch.equal(out, x)


def test_alignment_is_enforced(engine: FileIOEngine, tmp_path: Path) -> None:
    buf = HostBuffer(8192)
    with pytest.raises(ValueError, match="aligned"):
        engine.write(tmp_path / "x", buf.tensor[:100])
    with pytest.raises(ValueError, match="aligned"):
        engine.write(tmp_path / "x", buf.tensor[4096 : 4096 + 512])
    with pytest.raises(ValueError, match="aligned"):
        engine.write(tmp_path / "x", buf.tensor, offset=512)
    with pytest.raises(ValueError, match="writable"):
        engine.read(tmp_path / "x", memoryview(bytes(4096)))


@pytest.mark.parametrize("op,code", [("write", errno.ENOSPC), ("read", errno.EIO)])
def test_injected_errno_becomes_swap_io_error(tmp_path: Path, op: str, code: int) -> None:
    src = _filled(4 * BLOCK, 4)
    path = tmp_path / "e.swp"
    _write_plain(path, src)
    with FileIOEngine(BLOCK, 2, backend=FaultBackend(op, errno_=code, after=1, times=1)) as eng:
        fut = (
            eng.write(path, src.tensor)
            if op == "write"
            else eng.read(path, HostBuffer(4 * BLOCK).tensor)
        )
        with pytest.raises(SwapIOError) as info:
            fut.result(T)
    err = info.value
    assert err.errno == code and err.path == str(path) and err.offset is not None
    assert str(path) in str(err) and errno.errorcode[code] in str(err) and "offset" in str(err)
    assert isinstance(err, OSError)


def test_short_read_retried_once_then_error(tmp_path: Path) -> None:
    src = _filled(4 * BLOCK, 5)
    path = tmp_path / "s.swp"
    _write_plain(path, src)
    dst = HostBuffer(4 * BLOCK)
    with FileIOEngine(BLOCK, 2, backend=FaultBackend("read", short=4096, times=1)) as eng:
        eng.read(path, dst.tensor).result(T)  # one short transfer: remainder retried
    assert torch.equal(dst.tensor, src.tensor)
    with FileIOEngine(BLOCK, 2, backend=FaultBackend("read", short=4096)) as eng:
        with pytest.raises(SwapIOError, match="short read"):
            eng.read(path, dst.tensor).result(T)
    with FileIOEngine(BLOCK, 2, backend=FaultBackend("write", short=0)) as eng:
        with pytest.raises(SwapIOError, match="short write"):
            eng.write(path, src.tensor).result(T)


def test_file_too_short_and_missing(engine: FileIOEngine, tmp_path: Path) -> None:
    src = _filled(BLOCK, 6)
    engine.write(tmp_path / "short.swp", src.tensor).result(T)
    with pytest.raises(SwapIOError, match="file ends early"):
        engine.read(tmp_path / "short.swp", HostBuffer(3 * BLOCK).tensor).result(T)
    with pytest.raises(SwapIOError) as info:
        engine.read(tmp_path / "missing.swp", HostBuffer(BLOCK).tensor).result(T)
    assert info.value.errno == errno.ENOENT and "missing.swp" in str(info.value)


def test_o_direct_refused_falls_back_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src, dst = _filled(2 * BLOCK, 7), HostBuffer(2 * BLOCK)
    with caplog.at_level(logging.WARNING, logger="zero_offload.swap.io"):
        with FileIOEngine(BLOCK, 2, backend=FaultBackend("none", refuse_direct=True)) as eng:
            eng.write(tmp_path / "b.swp", src.tensor).result(T)
            eng.read(tmp_path / "b.swp", dst.tensor).result(T)
            eng.write(tmp_path / "c.swp", src.tensor).result(T)
    assert torch.equal(src.tensor, dst.tensor)
    warnings = [r for r in caplog.records if "O_DIRECT refused" in r.getMessage()]
    assert len(warnings) == 1


def test_close_finishes_in_flight_then_refuses(tmp_path: Path) -> None:
    src = _filled(8 * BLOCK, 8)
    eng = FileIOEngine(BLOCK, 2)
    futs = [eng.write(tmp_path / f"{i}.swp", src.tensor) for i in range(8)]
    eng.close()
    assert all(f.done() and f.exception() is None for f in futs)
    with pytest.raises(SwapIOError, match="closed"):
        eng.write(tmp_path / "late.swp", src.tensor)


def test_real_full_disk_is_enospc(tiny_tmpfs: Path, engine: FileIOEngine) -> None:
    src = _filled(2 * 1024 * 1024, 9)
    with pytest.raises(SwapIOError) as info:
        engine.write(tiny_tmpfs / "full.swp", src.tensor).result(T)
    assert info.value.errno == errno.ENOSPC and "ENOSPC" in str(info.value)


class _CountingBackend(OsBackend):
    """Counts open and close; ``gate`` (if set) holds an open, after the fd exists, until set."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate, self.opened, self.closed = gate, [], []
        self.in_open = threading.Event()
        self.lock = threading.Lock()

    def open(self, path: str, flags: int) -> int:
        fd = super().open(path, flags)
        with self.lock:
            self.opened.append(fd)
        self.in_open.set()
        if self.gate is not None:
            assert self.gate.wait(T)
        return fd

    def close(self, fd: int) -> None:
        with self.lock:
            self.closed.append(fd)
        super().close(fd)


def test_close_racing_a_write_refuses_it_without_leaking_the_fd(tmp_path: Path) -> None:
    src = _filled(BLOCK, 11)
    backend = _CountingBackend(gate=threading.Event())
    eng = FileIOEngine(BLOCK, 2, backend=backend)
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            eng.write(tmp_path / "racing.swp", src.tensor).result(T)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    th = threading.Thread(target=writer)
    th.start()
    assert backend.in_open.wait(T)  # the file is open, the request not yet queued
    eng.close()
    backend.gate.set()
    th.join(T)
    assert len(errors) == 1 and isinstance(errors[0], SwapIOError), errors
    assert "closed" in str(errors[0]) and "racing.swp" in str(errors[0])
    assert sorted(backend.opened) == sorted(backend.closed)  # no descriptor left open


def test_close_under_concurrent_writers(tmp_path: Path) -> None:
    """Every request racing close() either completes or fails with SwapIOError; no fd leaks."""
    src = _filled(BLOCK, 12)
    backend = _CountingBackend()
    eng = FileIOEngine(BLOCK, 2, backend=backend)
    outcomes: list[str] = []
    started = threading.Barrier(4)

    def writer(w: int) -> None:
        started.wait(T)
        for i in range(40):
            try:
                eng.write(tmp_path / f"{w}-{i}.swp", src.tensor).result(T)
                outcomes.append("ok")
            except SwapIOError:
                outcomes.append("refused")
            except BaseException as exc:  # noqa: BLE001
                outcomes.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    for th in threads:
        th.start()
    started.wait(T)
    while not backend.opened:
        time.sleep(0.001)
    eng.close()
    for th in threads:
        th.join(T)
    assert set(outcomes) <= {"ok", "refused"} and len(outcomes) == 120, set(outcomes)
    assert "refused" in outcomes
    assert sorted(backend.opened) == sorted(backend.closed)
