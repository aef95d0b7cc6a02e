"""Reduced gradients on their way to an offloaded optimizer (``grads.host``), and the
CPU side of ``device.streams``: pieces are summed in the background, ``flush`` waits for all
and raises the first failure, at most ``depth`` pieces are in flight, and a disk failure while
gradients go to NVMe surfaces from ``engine.backward``."""

from __future__ import annotations

import errno
import threading

import pytest
import torch
from support.swap_faults import FaultBackend

import zero_offload as zo
from zero_offload.device.streams import Streams
from zero_offload.grads.host import HostGradQueue
from zero_offload.grads.target import ResidentGrads
from zero_offload.swap import SwapIOError

CPU = Streams(torch.device("cpu"))


class _Failing(ResidentGrads):
    """Fails the piece at ``bad_offset``; sums the rest."""

    def __init__(self, grads: torch.Tensor, bad_offset: int) -> None:
        super().__init__(grads)
        self.bad_offset = bad_offset

    def accumulate_grad(self, offset: int, values: torch.Tensor, final: bool) -> None:
        if offset == self.bad_offset:
            raise OSError(errno.ENOSPC, "No space left on device")
        super().accumulate_grad(offset, values, final)


def test_pieces_are_summed_across_micro_steps():
    grads = torch.zeros(100)
    q = HostGradQueue(ResidentGrads(grads), CPU, largest_piece=40, dtype=torch.bfloat16)
    expected = torch.zeros(100)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # micro-steps
        for lo, hi in [(60, 100), (0, 30), (30, 60)]:  # any order, like a backward
            piece = torch.randn(hi - lo, generator=gen).bfloat16()
            expected[lo:hi] += piece.float()
            q.accumulate_grad(lo, piece, final=False)
        q.flush()
        assert torch.equal(grads, expected)
    q.zero_grad()  # a new window in which only (60, 100) gets a piece
    piece = torch.randn(40, generator=gen).bfloat16()
    q.accumulate_grad(60, piece, final=True)
    q.flush()
    assert torch.equal(grads[60:], piece.float()) and not grads[:60].any()
    q.close()


def test_zero_grad_writes_nothing_and_the_window_reads_whole():
    """``zero_grad`` leaves the shard as it is (no pass over it): a region's first piece of
    the window is copied in, later ones summed, and ``flush`` zeroes the regions no piece
    reached. Where autograd sums into the shard (an alias handed out), it zeroes at once."""
    grads = torch.zeros(96)
    target = ResidentGrads(grads)
    target.accumulate_grad(0, torch.full((32,), 5.0), final=True)
    target.accumulate_grad(32, torch.full((32,), 6.0), final=True)
    target.accumulate_grad(64, torch.full((32,), 7.0), final=True)
    target.flush()
    target.zero_grad()
    assert grads.eq(torch.tensor([5.0, 6.0, 7.0]).repeat_interleave(32)).all()  # untouched
    target.accumulate_grad(64, torch.full((32,), 1.0), final=False)
    target.accumulate_grad(64, torch.full((32,), 2.0), final=False)
    region = target.region(0, torch.empty(32))
    assert region is not None and target.region(0, torch.empty(32)) is None
    region.fill_(4.0)  # overwritten whole by its caller
    target.flush()
    assert torch.equal(grads[:32], torch.full((32,), 4.0))
    assert not grads[32:64].any()  # no piece this window: zero
    assert torch.equal(grads[64:], torch.full((32,), 3.0))  # copied, then summed
    target.accumulate_grad(32, torch.full((32,), 1.5), final=True)  # after the flush: summed
    assert torch.equal(grads[32:64], torch.full((32,), 1.5))
    target.zero_grad()  # every region reached: the flush writes nothing (an update that
    for lo in (0, 32, 64):  # stepped the landed units during backward stays valid)
        target.accumulate_grad(lo, torch.full((32,), 1.0), final=True)
    version = grads._version
    target.flush()
    assert grads._version == version and torch.equal(grads, torch.ones(96))

    aliased = ResidentGrads(torch.ones(64))
    view = aliased.alias(0, torch.empty(64))
    assert view is not None
    aliased.zero_grad()
    assert not view.any()


def test_flush_raises_the_first_failure_after_summing_the_rest():
    grads = torch.zeros(30)
    q = HostGradQueue(_Failing(grads, bad_offset=10), CPU, largest_piece=10, dtype=torch.float32)
    for lo in (0, 10, 20):
        q.accumulate_grad(lo, torch.ones(10), final=True)
    with pytest.raises(OSError, match="No space left"):
        q.flush()
    assert grads[:10].eq(1).all() and grads[20:].eq(1).all() and not grads[10:20].any()
    q.flush()  # the failure was reported once; the queue goes on
    q.close()


def test_at_most_depth_pieces_in_flight():
    gate = threading.Event()
    started = []

    class _Slow(ResidentGrads):
        def accumulate_grad(self, offset, values, final):
            started.append(offset)
            gate.wait(10)
            super().accumulate_grad(offset, values, final)

    grads = torch.zeros(40)
    q = HostGradQueue(_Slow(grads), CPU, largest_piece=10, dtype=torch.float32, depth=2)
    q.accumulate_grad(0, torch.ones(10), final=True)
    q.accumulate_grad(10, torch.ones(10), final=True)
    third = threading.Thread(target=q.accumulate_grad, args=(20, torch.ones(10), True))
    third.start()
    third.join(0.3)
    assert third.is_alive(), "a third piece must wait while two are in flight"
    gate.set()
    third.join(10)
    assert not third.is_alive()
    q.close()
    assert grads[:30].eq(1).all() and not grads[30:].any()


def test_cpu_streams_copy_only_when_asked():
    t = torch.arange(6, dtype=torch.float32)
    same, event = CPU.to_device(t)
    assert same is t and event is None
    own, _ = CPU.to_device(t, own=True)
    assert torch.equal(own, t) and own.data_ptr() != t.data_ptr()
    low, _ = CPU.to_device(t, torch.bfloat16)
    assert low.dtype == torch.bfloat16 and torch.equal(low.float(), t)
    out = torch.empty(6)
    assert CPU.to_host(t * 2, out) is None and torch.equal(out, t * 2)
    with CPU.on_gather(None):
        pass
    assert CPU.finish_gather(t, t) is None and not CPU.host_empty(4, torch.float32).is_pinned()
    CPU.sync_h2d()


def test_disk_failure_while_gradients_go_to_nvme_is_raised_by_backward(tmp_path):
    """Gradients on NVMe (the host budget cannot hold them): a failed write in the
    background summing surfaces from ``backward``, and the next backward works again."""

    def make() -> zo.Engine:
        torch.manual_seed(0)
        # many small units: the failure surfaces in the middle of backward, with reductions
        # still in flight, not only at its end
        model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(6)))
        return zo.initialize(
            model,
            stage=2,
            offload_optimizer="nvme",
            nvme_path=tmp_path,
            host_memory_limit=8 * 2**20,
            reduce_bucket_size=1 << 16,
        )

    engine, clean = make(), make()
    assert engine.grads is None, "the gradients must go to NVMe for this test"
    swapper = engine.swappers[0]
    x = torch.randn(4, 512)
    swapper.engine.backend = FaultBackend("write", errno_=errno.EIO)
    with pytest.raises(SwapIOError, match="Input/output error"):
        engine.backward(engine(x).square().mean())
    swapper.engine.backend = FaultBackend("none")
    engine.zero_grad()  # nothing of the failed backward is left behind
    for e in (engine, clean):
        e.backward(e(x).square().mean())
        assert e.step()
    got, expected = engine.full_state_dict(), clean.full_state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    engine.close()
    clean.close()


def test_worker_thread_uses_the_engine_device(monkeypatch):
    """On CUDA the worker thread makes the engine's GPU current before it touches the
    runtime (event waits): otherwise a thread's first CUDA call creates a context on GPU 0,
    in every rank."""
    import types

    made_current = []
    monkeypatch.setattr(
        torch.cuda,
        "set_device",
        lambda device: made_current.append((threading.current_thread().name, torch.device(device))),
    )
    streams = types.SimpleNamespace(cuda=False, device=torch.device("cuda", 1))
    grads = torch.zeros(8)
    q = HostGradQueue(ResidentGrads(grads), streams, largest_piece=8, dtype=torch.float32)
    q.accumulate_grad(0, torch.ones(8), final=True)
    q.flush()
    q.close()
    assert torch.equal(grads, torch.ones(8))
    assert [(name.startswith("zo-host-grads"), dev) for name, dev in made_current] == [
        (True, torch.device("cuda", 1))
    ]
