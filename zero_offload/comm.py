"""A thin face over ``torch.distributed`` that also works without a process group.

Every collective the engine issues goes through :class:`Comm`, which (1) turns into a local
copy when the world size is 1, so a single process needs no ``init_process_group``, and (2)
counts what each kind of collective moved, for ``memory_report()`` and the communication tests.

Counted volume is what one rank sends on the wire with ring algorithms: all-gather and
reduce-scatter of a full tensor of S elements move S·(N−1)/N, all-reduce twice that. With it,
ZeRO's claims read directly: stages 1–2 move ≈ 2Ψ per step, stage 3 ≈ 3Ψ (× (N−1)/N).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

# Imported now, before the user's init_process_group: this module's functions take
# ``group=group.WORLD`` as a default, evaluated at import. Imported later (torch._dynamo
# imports it, and torch.optim's first step imports torch._dynamo), that default holds the
# default process group, so destroy_process_group cannot free it: its gloo threads run on
# until the interpreter's teardown destroys it, which can abort the finished process
# ("terminate called without an active exception"). See examples/gloo_teardown.py.
import torch.distributed.nn.functional

__all__ = ["Comm", "CollectiveStats", "Handle"]


class Handle(Protocol):
    def wait(self) -> Any: ...


class _Done:
    """The handle of a collective that finished at once (world size 1)."""

    def wait(self) -> bool:
        return True


@dataclass
class CollectiveStats:
    calls: int = 0
    elements: int = 0  # wire elements per rank (ring estimate, see module docstring)
    bytes: int = 0


def _all_gather_fn():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_fn():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Comm:
    """Collectives over one process group (None: the default group, or a single process)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if initialized else 1
        self.rank = dist.get_rank(group) if initialized else 0
        self._stats: dict[str, CollectiveStats] = defaultdict(CollectiveStats)

    # -- counters ---------------------------------------------------------------------------
    def _count(self, kind: str, numel: int, element_size: int, factor: float) -> None:
        n = self.world_size
        wire = int(round(numel * factor * (n - 1) / n))
        s = self._stats[kind]
        s.calls += 1
        s.elements += wire
        s.bytes += wire * element_size

    def count_all_gather(self, output: torch.Tensor) -> None:
        """Count an all-gather into ``output`` that one rank did without calling it (its
        shard is the whole output), as :meth:`all_gather` counts it."""
        self._count("all_gather", output.numel(), output.element_size(), 1.0)

    def stats(self) -> dict[str, CollectiveStats]:
        """Counters since the last :meth:`reset_stats`, by collective kind."""
        return {k: CollectiveStats(v.calls, v.elements, v.bytes) for k, v in self._stats.items()}

    def reset_stats(self) -> None:
        self._stats.clear()

    # -- collectives -------------------------------------------------------------------------
    def all_gather(
        self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False
    ) -> Handle:
        """Concatenate every rank's ``shard`` (equal sizes) into ``output``."""
        self._count("all_gather", output.numel(), output.element_size(), 1.0)
        if self.world_size == 1:
            output.copy_(shard)
            return _Done()
        work = _all_gather_fn()(output, shard, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def reduce_scatter(
        self, output: torch.Tensor, full: torch.Tensor, async_op: bool = False
    ) -> Handle:
        """Sum ``full`` over ranks and leave this rank's slice in ``output`` (on one rank
        ``output`` may be ``full`` itself: nothing to do)."""
        self._count("reduce_scatter", full.numel(), full.element_size(), 1.0)
        if self.world_size == 1:
            if output.data_ptr() != full.data_ptr():
                output.copy_(full)
            return _Done()
        work = _reduce_scatter_fn()(
            output, full, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op
        )
        return work if async_op else _Done()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Handle:
        """Reduce ``tensor`` in place over ranks (``op``: sum or max)."""
        self._count("all_reduce", tensor.numel(), tensor.element_size(), 2.0)
        if self.world_size == 1:
            return _Done()
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        work = dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=async_op)
        return work if async_op and work is not None else _Done()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Copy rank ``src``'s tensor (a rank of this group) to every rank."""
        self._count("broadcast", tensor.numel(), tensor.element_size(), 1.0)
        if self.world_size == 1:
            return
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        dist.broadcast(tensor, src=global_src, group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (small metadata only)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
