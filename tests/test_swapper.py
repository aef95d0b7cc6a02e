"""Swapper: tiers, round trips, run directories, cleanup, and clear errors."""

from __future__ import annotations

import errno
import gc
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from support.swap_faults import FaultBackend, mounted_tmpfs

from zero_offload.errors import SwapIOError, SwapSpaceError
from zero_offload.swap.buffers import BufferPool, HostBuffer
from zero_offload.swap.folder import FILES
from zero_offload.swap.io import FileIOEngine
from zero_offload.swap.swapper import Swapper, Tier

T = 10
BUF = 64 * 1024


def _swapper(path: Path, **kw) -> Swapper:
    kw.setdefault("buffer_count", 3)
    kw.setdefault("host_memory_limit", 1 << 30)
    kw.setdefault("acquire_timeout", 5.0)
    kw.setdefault("engine", None)
    return Swapper(path, BUF, **kw)


def test_round_trip_unaligned_shapes_and_dtypes(tmp_path: Path) -> None:
    tensors = {
        "fp32": torch.randn(1001),
        "bf16": torch.randn(7, 333).to(torch.bfloat16),
        "i64": torch.arange(12345, dtype=torch.int64)[::3].clone(),
        "noncontig": torch.randn(40, 30).t(),
    }
    with _swapper(tmp_path) as sw:
        futs = [sw.swap_out(k, t) for k, t in tensors.items()]
        for f in futs:
            f.result(T)
        for k, t in tensors.items():
            out = torch.empty(t.shape, dtype=t.dtype)
            assert sw.swap_in(k, out).result(T) is out
            assert torch.equal(out, t), k
            assert sw.where(k) is Tier.NVME
        assert sw.pool.available == sw.pool.count  # every staging buffer went back


def test_direct_path_and_prefetch_compute_write_back(tmp_path: Path) -> None:
    src = HostBuffer(BUF).view(torch.float32, (BUF // 4,))  # aligned: written without staging
    src.copy_(torch.arange(BUF // 4, dtype=torch.float32))
    with _swapper(tmp_path) as sw:
        sw.swap_out("m", src).result(T)
        assert sw.nbytes_by_tier() == {Tier.DEVICE: 0, Tier.HOST: 0, Tier.NVME: BUF}
        view = sw.prefetch("m").result(T)
        assert sw.where("m") is Tier.HOST and sw.pool.available == sw.pool.count - 1
        assert sw.prefetch("m").result(T).data_ptr() == view.data_ptr()  # no second read
        assert torch.equal(view, src)
        view.mul_(2)
        sw.swap_out("m", view).result(T)  # straight from the pool buffer
        assert sw.nbytes_by_tier()[Tier.HOST] == BUF
        sw.release("m")
        assert sw.where("m") is Tier.NVME and sw.pool.available == sw.pool.count
        out = HostBuffer(BUF).view(torch.float32, (BUF // 4,))
        sw.swap_in("m", out).result(T)
        assert torch.equal(out, src * 2)


def test_owned_buffer_is_written_in_place_and_returned(tmp_path: Path) -> None:
    """A buffer from acquire() is filled by the caller and written from where it is (an
    unaligned size: the padding is zeroed); it goes back to the pool once written, and a
    tensor that does not start it is refused."""
    with _swapper(tmp_path) as sw:
        buf = sw.acquire(1001 * 2, "p")
        assert sw.pool.available == sw.pool.count - 1
        values = buf.view(torch.bfloat16, (1001,))
        values.copy_(torch.randn(1001))
        want = values.clone()
        with pytest.raises(ValueError, match="does not start"):
            sw.swap_out("p", values[1:], owned=buf)
        sw.swap_out("p", values, owned=buf).result(T)
        assert sw.pool.available == sw.pool.count and sw.where("p") is Tier.NVME
        out = torch.empty(1001, dtype=torch.bfloat16)
        sw.swap_in("p", out).result(T)
        assert torch.equal(out, want)


def test_an_owned_buffer_goes_back_when_its_write_cannot_start(tmp_path: Path) -> None:
    """A full disk refuses a new key's file before any write starts: the buffer handed over
    as ``owned`` goes back to the pool all the same. (It did not: a pass during backward
    that met a full disk kept one buffer of three for good, and the step's read-ahead then
    waited ``acquire_timeout`` for it instead of failing with the disk's error.)"""

    class _Full:  # the real disk, with no room left for a new file
        def __getattr__(self, name):
            return getattr(FILES, name)

        def free_bytes(self, path: Path) -> int:
            return 0

    with _swapper(tmp_path) as sw:
        buf = sw.acquire(4096, "p")
        sw._folder.disk = _Full()
        with pytest.raises(SwapSpaceError):
            sw.swap_out("p", buf.view(torch.float32, (1024,)), owned=buf)
        assert sw.pool.available == sw.pool.count
        kept = sw.acquire(4096, "q")
        with pytest.raises(SwapSpaceError):
            sw.swap_out("q", kept.view(torch.float32, (1024,)), owned=kept, keep=True)
        assert sw.pool.available == sw.pool.count


class _GatedWrites(FaultBackend):
    """Writes wait for ``gate``; reads fail (nothing may be read back from the disk)."""

    def __init__(self) -> None:
        super().__init__("read", errno_=errno.EIO)
        self.gate = threading.Event()

    def pwritev(self, fd, buffers, offset):
        assert self.gate.wait(T)
        return super().pwritev(fd, buffers, offset)


def test_kept_buffer_is_read_while_written_and_given_back_after(tmp_path: Path) -> None:
    """swap_out(owned=, keep=True): the buffer stays as the key's host copy, so a read that
    follows takes it at once, with no disk read, even while the write is in flight; a
    release() during the write gives the buffer back when the write is done, not before
    (the write still reads it), unless a read takes it again first."""
    with _swapper(tmp_path) as sw:
        gated = _GatedWrites()
        sw.engine.backend = gated
        buf = sw.acquire(1001 * 2, "p")
        values = buf.view(torch.bfloat16, (1001,))
        values.copy_(torch.randn(1001))
        want = values.clone()
        written = sw.swap_out("p", values, owned=buf, keep=True)
        got = sw.prefetch("p").result(T)  # the write is held at the gate: read from memory
        assert not written.done() and torch.equal(got, want)
        sw.release("p")
        assert sw.pool.available == sw.pool.count - 1  # still read by the write
        again = sw.prefetch("p").result(T)  # taken again before the write ends
        gated.gate.set()
        written.result(T)
        assert sw.pool.available == sw.pool.count - 1 and torch.equal(again, want)
        sw.release("p")
        assert sw.pool.available == sw.pool.count and sw.where("p") is Tier.NVME
        buf = sw.acquire(1001 * 2, "p")  # released during the write: back once it is done
        gated.gate.clear()
        sw.swap_out("p", buf.view(torch.bfloat16, (1001,)), owned=buf, keep=True)
        sw.release("p")
        assert sw.pool.available == sw.pool.count - 1
        gated.gate.set()
        deadline = time.monotonic() + T
        while sw.pool.available < sw.pool.count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sw.pool.available == sw.pool.count


def test_many_keys_in_flight_with_few_buffers(tmp_path: Path) -> None:
    data = [torch.randn(5000) for _ in range(12)]
    with _swapper(tmp_path, buffer_count=2) as sw:
        futs = [sw.swap_out(f"k{i}", t) for i, t in enumerate(data)]  # back-pressure on 2 buffers
        for f in futs:
            f.result(T)
        outs = [torch.empty(5000) for _ in data]
        futs = [sw.swap_in(f"k{i}", o) for i, o in enumerate(outs)]
        for f in futs:
            f.result(T)
        assert all(torch.equal(a, b) for a, b in zip(data, outs))


def test_run_dirs_are_unique_and_removed(tmp_path: Path) -> None:
    a, b = _swapper(tmp_path), _swapper(tmp_path, rank=1)
    assert a.run_id != b.run_id
    assert a.rank_dir == tmp_path / a.run_id / "rank0" and b.rank_dir.name == "rank1"
    a.swap_out("x", torch.ones(10)).result(T)
    assert len(list(a.rank_dir.glob("*.swp"))) == 1
    a.close()
    assert not (tmp_path / a.run_id).exists()
    with pytest.raises(RuntimeError):
        a.swap_out("x", torch.ones(10))
    rank_dir = b.rank_dir
    del b
    gc.collect()
    assert not rank_dir.exists()  # finalizer ran on garbage collection


def test_files_removed_at_normal_exit(tmp_path: Path) -> None:
    code = (
        "import sys, torch; from zero_offload.swap.swapper import Swapper; "
        f"s = Swapper({str(tmp_path)!r}, 65536, host_memory_limit=1<<30); "
        "s.swap_out('k', torch.ones(100)).result(); print(s.rank_dir); sys.stdout.flush()"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert res.returncode == 0, res.stderr
    assert not Path(res.stdout.strip()).exists() and list(tmp_path.iterdir()) == []


def test_reusing_a_run_dir_is_refused(tmp_path: Path) -> None:
    with _swapper(tmp_path, run_id="fixed") as sw:
        with pytest.raises(SwapIOError, match="never reuses"):
            _swapper(tmp_path, run_id="fixed")
        assert sw.rank_dir.exists()


def test_never_written_and_missing_file(tmp_path: Path) -> None:
    with _swapper(tmp_path) as sw:
        with pytest.raises(SwapIOError, match="never written"):
            sw.swap_in("nope", torch.empty(4))
        with pytest.raises(SwapIOError, match="never written"):
            sw.prefetch("nope")
        sw.swap_out("k", torch.ones(100)).result(T)
        next(sw.rank_dir.glob("*.swp")).unlink()  # deleted behind our back
        with pytest.raises(SwapIOError) as info:
            sw.swap_in("k", torch.empty(100)).result(T)
        assert info.value.errno == errno.ENOENT
        assert sw.pool.available == sw.pool.count
        with pytest.raises(ValueError, match="stored is"):
            sw.swap_in("k", torch.empty(99))


def test_failed_write_leaves_no_valid_copy(tmp_path: Path) -> None:
    eng = FileIOEngine(
        16384, 2, backend=FaultBackend("write", errno_=errno.ENOSPC, after=2, times=1)
    )
    with _swapper(tmp_path, engine=eng) as sw:  # call 1 is the probe, call 2 the first write
        sw.swap_out("k", torch.ones(100)).result(T)
        with pytest.raises(SwapIOError) as info:
            sw.swap_out("k", torch.full((100,), 2.0)).result(T)
        assert info.value.errno == errno.ENOSPC
        with pytest.raises(SwapIOError, match="last swap_out failed"):
            sw.swap_in("k", torch.empty(100))
        assert sw.where("k") is None
        sw.swap_out("k", torch.full((100,), 3.0)).result(T)  # retry succeeds
        out = torch.empty(100)
        sw.swap_in("k", out).result(T)
        assert torch.equal(out, torch.full((100,), 3.0))
    eng.close()


def test_failed_prefetch_returns_buffer(tmp_path: Path) -> None:
    eng = FileIOEngine(16384, 2, backend=FaultBackend("read", errno_=errno.EIO, times=1))
    with _swapper(tmp_path, engine=eng) as sw:
        sw.swap_out("k", torch.ones(100)).result(T)
        with pytest.raises(SwapIOError, match="EIO"):
            sw.prefetch("k").result(T)
        assert sw.where("k") is Tier.NVME and sw.pool.available == sw.pool.count
        assert torch.equal(sw.prefetch("k").result(T), torch.ones(100))
    eng.close()


def test_unwritable_nvme_path(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(SwapIOError, match="nvme_path"):
        _swapper(afile)
    with mounted_tmpfs(tmp_path / "ro", "ro,size=1M") as ro:
        with pytest.raises(SwapIOError, match="nvme_path") as info:
            _swapper(ro)
        assert info.value.errno == errno.EROFS


def test_free_space_checked_up_front(tmp_path: Path) -> None:
    with pytest.raises(SwapSpaceError) as info:
        _swapper(tmp_path, expected_bytes=1 << 60)
    msg = str(info.value)
    assert str(tmp_path) in msg and str(1 << 60) in msg and "available" in msg
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_full_small_filesystem(tiny_tmpfs: Path) -> None:
    with pytest.raises(SwapSpaceError):
        _swapper(tiny_tmpfs, expected_bytes=2 << 20)
    pool = BufferPool(4 << 20, 2, host_memory_limit=1 << 30)
    with Swapper(tiny_tmpfs, 4 << 20, pool=pool, acquire_timeout=5) as sw:
        with pytest.raises(SwapSpaceError):
            sw.swap_out("big", torch.ones(1 << 20))  # 4 MiB cannot fit in 1 MiB: refused up front
        sw.swap_out("a", torch.ones(200_000)).result(T)  # 800 kB fits
        with pytest.raises(SwapIOError) as info:
            sw.swap_out("b", torch.ones(100_000)).result(T)  # 400 kB more does not
        assert info.value.errno == errno.ENOSPC
        out = torch.empty(200_000)
        sw.swap_in("a", out).result(T)
        assert torch.equal(out, torch.ones(200_000))
    pool.close()


def test_pool_exhaustion_times_out_and_shard_too_big(tmp_path: Path) -> None:
    with _swapper(tmp_path, buffer_count=1, acquire_timeout=0.2) as sw:
        sw.swap_out("a", torch.ones(10)).result(T)
        sw.swap_out("b", torch.ones(10)).result(T)
        sw.prefetch("a").result(T)
        with pytest.raises(TimeoutError):
            sw.prefetch("b")
        sw.release("a")
        sw.prefetch("b").result(T)
        with pytest.raises(ValueError, match="buffer_bytes"):
            sw.swap_out("huge", torch.ones(BUF + 1))  # size not a multiple of 4096: needs staging


def test_a_key_written_after_a_discard_gets_a_file_of_its_own(tmp_path: Path) -> None:
    """File names carry a running number because keys are shortened to a safe prefix; a
    number taken from the count of keys comes round again after a discard, and keys alike
    in their first 48 characters would then share one file."""
    prefix = "layers." + "x" * 60  # longer than the part of a key a file name keeps
    first, second, third = torch.full((100,), 1.0), torch.full((100,), 2.0), torch.full((100,), 3.0)
    with _swapper(tmp_path) as sw:
        sw.swap_out(prefix + ".a", first).result(T)
        sw.swap_out(prefix + ".b", second).result(T)
        sw.discard(prefix + ".a")
        sw.swap_out(prefix + ".c", third).result(T)
        assert torch.equal(sw.swap_in(prefix + ".b").result(T), second)
        sw.release(prefix + ".b")
        assert torch.equal(sw.swap_in(prefix + ".c").result(T), third)
        sw.release(prefix + ".c")
        assert len(list(sw.rank_dir.glob("*.swp"))) == 2


def test_a_key_takes_over_another_keys_file(tmp_path: Path) -> None:
    """What a new value written beside the old one needs to become the value: no copy."""
    old, new = torch.full((100,), 1.0), torch.full((100,), 2.0)
    with _swapper(tmp_path) as sw:
        sw.swap_out("state", old).result(T)
        sw.swap_out("state.next", new)  # still being written: take_over waits for it
        sw.take_over("state", "state.next")
        assert sw.where("state.next") is None
        assert torch.equal(sw.swap_in("state").result(T), new)
        sw.release("state")
        assert len(list(sw.rank_dir.glob("*.swp"))) == 1  # the old file went
        with pytest.raises(SwapIOError, match="never written"):
            sw.take_over("state", "missing")
        assert torch.equal(sw.swap_in("state").result(T), new)  # unchanged by the refusal
        sw.release("state")
        assert sw.pool.available == sw.pool.count


def test_a_read_buffer_taken_over_leaves_the_key_its_file(tmp_path: Path) -> None:
    """The buffer a read filled, changed in place and written under another key: the first
    key still reads its old value from disk."""
    with _swapper(tmp_path) as sw:
        sw.swap_out("state", torch.full((1000,), 1.0)).result(T)
        view = sw.prefetch("state").result(T)
        buf = sw.take_buffer("state")
        view.add_(1.0)
        sw.swap_out("state.next", view, owned=buf).result(T)
        assert torch.equal(sw.swap_in("state").result(T), torch.full((1000,), 1.0))
        sw.release("state")
        assert torch.equal(sw.swap_in("state.next").result(T), torch.full((1000,), 2.0))
        sw.release("state.next")
        assert sw.pool.available == sw.pool.count
        with pytest.raises(SwapIOError, match="no host copy"):
            sw.take_buffer("state")


def _interrupt_at_line(n: int, files: tuple[str, ...]):
    """A tracer that sends this process SIGINT at the ``n``-th line the main thread runs in
    ``files``: the signal lands between any two lines of the swapper, as Ctrl-C can. The
    wrapper that holds signals around each call is not counted: before it, the call has not
    begun (an owned buffer is still the caller's)."""
    import signal

    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == n:
                signal.raise_signal(signal.SIGINT)
        return local

    def tracer(frame, event, arg):
        if frame.f_code.co_name == "held" or not frame.f_code.co_filename.endswith(files):
            return None
        return local

    return tracer, seen


@pytest.mark.parametrize("call", ["prefetch", "swap_in", "swap_out", "swap_out_owned"])
def test_ctrl_c_at_any_line_of_a_call_leaves_every_key_readable(tmp_path: Path, call) -> None:
    """SIGINT landing anywhere inside a swapper call (the main thread runs them while a user
    presses Ctrl-C in forward or backward) must leave its bookkeeping whole: afterwards the
    key reads back its last complete value without waiting forever, and every pool buffer
    comes back. A KeyboardInterrupt between starting a read and recording it once left a
    future nothing would complete, and the engine's close() waited on it."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    files = ("swap/swapper.py", "swap/keys.py")
    try:
        n, interrupted_somewhere = 0, True
        while interrupted_somewhere:
            n += 1
            old, new = torch.full((1000,), 1.0), torch.full((1000,), 2.0)
            with _swapper(tmp_path / str(n)) as sw:
                sw.swap_out("k", old).result(T)
                if call == "prefetch":
                    sw.prefetch("k").result(T)
                    sw.release("k")
                if call == "swap_out_owned":  # the buffer is the caller's until swap_out
                    buf = sw.acquire(4000, "k")
                    view = buf.view(torch.float32, (1000,))
                    view.copy_(new)
                tracer, seen = _interrupt_at_line(n, files)
                sys.settrace(tracer)
                try:
                    if call in ("prefetch", "swap_in"):
                        getattr(sw, call)("k").result(T)
                    elif call == "swap_out":
                        sw.swap_out("k", new, copy=True).result(T)
                    else:
                        sw.swap_out("k", view, owned=buf).result(T)
                except KeyboardInterrupt:
                    pass
                finally:
                    sys.settrace(None)
                interrupted_somewhere = seen[0] >= n
                got = sw.prefetch("k").result(T).clone()
                assert torch.equal(got, old) or torch.equal(got, new), n
                sw.release("k")
                deadline = time.monotonic() + T  # a write the interrupt left in flight
                while sw.pool.available < sw.pool.count and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert sw.pool.available == sw.pool.count, f"a buffer lost at line {n}"
    finally:
        signal.signal(signal.SIGINT, previous)
