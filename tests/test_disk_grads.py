"""The gradient shard in files (DiskGrads): pieces in any order and size, summed over several
backwards with fewer host buffers than sub-groups, read back exactly, with the norm the step
clips by."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from support.swap_faults import FaultBackend

from zero_offload.errors import SwapIOError
from zero_offload.grads.disk import DiskGrads


def _pieces(numel: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """[lo, hi) pieces covering [0, numel) once, of random sizes, in random order."""
    cuts = sorted(set(torch.randint(1, numel, (12,), generator=gen).tolist()))
    bounds = list(zip([0, *cuts], [*cuts, numel]))
    return [bounds[i] for i in torch.randperm(len(bounds), generator=gen).tolist()]


def _read_back(grads: DiskGrads, groups: int | None = None) -> torch.Tensor:
    """The sums in the first ``groups`` sub-groups' files (default: all), as the step reads."""
    out = torch.zeros(grads.numel)
    for i, (lo, hi) in enumerate(grads.bounds[:groups]):
        out[lo:hi] = grads.prefetch(i).result()
        grads.release(i)
    return out


def test_sums_pieces_in_any_order_over_backwards_and_reads_them_back(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    numel, group = 5 * 1024 + 300, 1024  # six sub-groups, the last one short
    grads = DiskGrads(tmp_path, numel, group, buffers=2, rank=0)  # evictions on the way
    try:
        assert grads.bounds[-1] == (5 * 1024, numel) and grads.buffers == 2
        want = torch.zeros(numel, dtype=torch.float64)
        for _backward in range(3):
            for lo, hi in _pieces(numel, gen):
                piece = torch.randn(hi - lo, generator=gen)
                want[lo:hi] += piece.double()
                grads.accumulate_grad(lo, piece, final=False)
        sumsq, finite = grads.stats()
        got = _read_back(grads)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        assert finite
        assert abs(sumsq - float(got.double().square().sum())) <= 1e-9 * sumsq

        grads.zero_grad()  # a new window: the files are overwritten, not summed into
        grads.accumulate_grad(0, torch.full((numel,), float("inf")), final=True)
        assert grads.stats() == (float("inf"), False)
        assert torch.isinf(_read_back(grads)).all()
    finally:
        grads.close()


def test_partial_sub_groups_are_written_by_flush(tmp_path: Path) -> None:
    """Late pieces (reduced at the step) leave sub-groups partly covered: ``stats`` writes
    them out first, and they count in the norm."""
    grads = DiskGrads(tmp_path, 4096, 1024, buffers=2, rank=0)
    try:
        grads.accumulate_grad(1000, torch.full((100,), 2.0), final=True)
        sumsq, finite = grads.stats()
        assert finite and abs(sumsq - 100 * 4.0) <= 1e-9 * 400
        got = _read_back(grads, groups=2)  # the two sub-groups the piece touched
        assert (
            got[1000:1100].eq(2.0).all() and got[:1000].eq(0).all() and got[1100:2048].eq(0).all()
        )
    finally:
        grads.close()


def test_one_backwards_bf16_sums_are_stored_in_bf16_and_widened_to_sum_more(tmp_path: Path):
    """A sub-group whose sums are all exact in the compute dtype (one backward's reduced
    pieces) is stored in it: half the bytes written in backward and read by the step. A
    second backward in the window reads it back widened and sums in fp32 as before."""
    gen = torch.Generator().manual_seed(1)
    numel, group = 5 * 1024 + 300, 1024
    grads = DiskGrads(tmp_path, numel, group, buffers=2, rank=0, narrow=torch.bfloat16)
    try:
        first = torch.randn(numel, generator=gen).bfloat16()
        for lo, hi in _pieces(numel, gen):
            grads.accumulate_grad(lo, first[lo:hi], final=True)
        sumsq, _ = grads.stats()
        for i in range(6):
            assert grads.prefetch(i).result().dtype == torch.bfloat16
            grads.release(i)
        assert torch.equal(_read_back(grads), first.float())
        assert sum(grads.stored_bytes(i) for i in range(6)) == 2 * numel
        assert abs(sumsq - float(first.double().square().sum())) <= 1e-9 * sumsq

        second = torch.randn(numel, generator=gen).bfloat16()
        for lo, hi in _pieces(numel, gen):
            grads.accumulate_grad(lo, second[lo:hi], final=True)
        grads.stats()
        got = _read_back(grads)
        assert torch.equal(got, first.float() + second.float())  # summed in fp32
        assert grads.prefetch(0).result().dtype == torch.float32  # a sum bf16 cannot hold
        grads.release(0)

        grads.zero_grad()
        grads.accumulate_grad(0, torch.full((numel,), 0.1), final=True)  # fp32 pieces
        grads.stats()
        assert torch.equal(_read_back(grads), torch.full((numel,), 0.1))
        assert grads.stored_bytes(0) == 4 * group
    finally:
        grads.close()


def test_a_failed_write_leaves_the_window_refused_until_zero_grad(tmp_path: Path) -> None:
    """A sub-group's sum whose write failed is gone; summing on would restart it from
    zeros and step with that. Everything refuses until ``zero_grad()`` starts over."""
    grads = DiskGrads(tmp_path, 4096, 1024, buffers=2, rank=0)
    try:
        grads.accumulate_grad(0, torch.full((1024,), 1.0), final=False)  # written out
        grads.swapper.engine.backend = FaultBackend("write", errno_=errno.EIO, times=1)
        with pytest.raises(SwapIOError, match="Input/output error"):
            grads.accumulate_grad(1024, torch.full((2048,), 2.0), final=False)
        grads.swapper.engine.backend = FaultBackend("none")
        for go_on in (
            lambda: grads.accumulate_grad(1024, torch.full((1024,), 3.0), final=False),
            grads.flush,
            grads.stats,
            lambda: grads.prefetch(0),
        ):
            with pytest.raises(SwapIOError, match="zero_grad"):
                go_on()
        grads.zero_grad()
        grads.accumulate_grad(0, torch.full((4096,), 5.0), final=True)
        assert grads.stats() == (4096 * 25.0, True)
        assert _read_back(grads).eq(5.0).all()
    finally:
        grads.close()
